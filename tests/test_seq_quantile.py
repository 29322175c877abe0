"""seq_quantile(x, q), the per-response sibling of batch_quantile: its value and gradient against torch's own
(torch.quantile over each response's unmasked tokens), masked and empty responses, the parser's refusals,
its level and locality, the analysis's statement, the loss on every path against an independent float64
loop over each response's sorted tokens, and what the hosts give it (a response is whole in every loss
call: no collective, nothing from other micro-batches). Its row's generated checks (fused == plain ==
its definition, ties and masked NaN included) are tests/test_reductions.py's."""
import math

import pytest
import torch

import dsl
from openrlhf_drpo.core.reductions import NAMESPACE
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report
from openrlhf_drpo.core import Aggregation, CompiledLoss
from test_library_v3 import PATHS, batch, dirty

F64 = torch.float64
HELPERS = {"torch": torch, "math": math, **NAMESPACE}


def seq_quantile(x, m, q):
    return HELPERS["_seq_quantile"](x, m, x, q)


# ---------------------------------------------------------------- torch's own
@pytest.mark.parametrize("q", [0.0, 0.25, 0.3, 0.5, 0.9, 1.0])
def test_seq_quantile_is_torch_quantile_of_each_responses_unmasked_tokens_bit_for_bit_and_in_its_gradient(q):
    g = torch.Generator().manual_seed(1)
    x, m = torch.randn(6, 9, generator=g, dtype=F64) * 10, torch.rand(6, 9, generator=g) > 0.3
    m[4] = False
    ours_x = x.clone().requires_grad_()
    got = seq_quantile(dirty(ours_x, m), m, q)
    for b in range(6):
        if not m[b].any():
            assert not got[b].any()         # an empty response reduces to 0
            continue
        theirs_x = x.clone().requires_grad_()
        want = torch.quantile(theirs_x[b][m[b]], q)
        assert torch.equal(got[b], want.expand(9)), (b, got[b], want)
        (g_ours,), (g_theirs,) = (torch.autograd.grad(got[b, 0], ours_x, retain_graph=True),
                                  torch.autograd.grad(want, theirs_x))
        assert torch.equal(g_ours, g_theirs)    # (1 − f, f) on its two neighbours, nothing on another response


def test_a_nan_token_makes_its_own_responses_quantile_nan_and_no_other():
    x = torch.tensor([[0.5, math.nan, 2.0], [1.0, 3.0, 2.0]], dtype=F64)
    m = torch.ones_like(x, dtype=torch.bool)
    got = seq_quantile(x, m, 0.5)
    assert got[0].isnan().all() and torch.equal(got[1], torch.full((3,), 2.0, dtype=F64))
    m[0, 1] = False         # masked, it is not read
    assert torch.equal(seq_quantile(x, m, 0.5)[0], torch.full((3,), 1.25, dtype=F64))


def test_a_response_with_no_token_slot_reduces_to_an_empty_value_still_on_the_graph():
    x = torch.zeros(3, 0, dtype=F64, requires_grad=True)
    got = seq_quantile(x, torch.zeros(3, 0, dtype=torch.bool), 0.5)
    assert got.shape == (3, 0) and got.requires_grad


# ---------------------------------------------------------------- the language
@pytest.mark.parametrize("text, level, locality, width", [
    ("r*A*seq_quantile(r, 0.3)", "response", "response", "response"),
    ("r*A*seq_quantile(seq_mean(r), 0.3)", "response", "response", "response"),
    ("r*seq_quantile(A, 0.5)", "response", "token", "token"),
    ("[r >= seq_quantile(r, 0.9)]*r*A", "response", "response", "token"),
])
def test_seq_quantile_is_a_response_value_and_its_objectives_locality_is_the_response(text, level, locality, width):
    obj = dsl.parse(text)
    node = next(n for n in obj.expr.walk() if n.op == "seq_quantile")
    assert obj.facts.level[node] == level
    assert (obj.facts.locality, obj.facts.gradient_width, obj.facts.kept_whole) == (locality, width, ())


def test_the_analysis_holds_it_on_the_uniform_response_and_says_so():
    text = " ".join(report(analyze(dsl.parse("r*A*seq_quantile(r, 0.9)", "x.dsl")), width=None).split())
    assert "seq_mean(x) = seq_max(x) = seq_min(x) = seq_quantile(x, q) = x" in text, text
    assert "w = 2·r" in text, text         # r·A·r on the uniform response: ∂/∂r = 2r·A
    plain = " ".join(report(analyze(dsl.parse("r*A*seq_max(r)", "x.dsl")), width=None).split())
    assert "seq_min(x) = x" in plain and "seq_quantile" not in plain     # said only where read


# ---------------------------------------------------------------- the loss, by an independent loop
OBJECTIVE = "[r >= seq_quantile(r, 0.7)]*r*A + 0.1*A*seq_quantile(log(π), 0.25)"


def _loop_quantile(values, q):
    """torch.quantile's definition, by hand: the sorted values' lerp at q·(n − 1); the two neighbours
    are picked by index, so autograd sends (1 − f, f) to them (the batch holds no ties)."""
    n = len(values)
    order = sorted(range(n), key=lambda k: float(values[k].detach()))
    rank = q * (n - 1)
    low, high = values[order[math.floor(rank)]], values[order[math.ceil(rank)]]
    return low + (rank - math.floor(rank)) * (high - low)


def reference(b, logp):
    """−(1/Σ mask)·Σ_tokens ℓ, ℓ from each response's own quantiles, by loops (token-mean)."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        at = b["mask"][i].nonzero().flatten().tolist()
        if not at:
            continue
        r = [torch.exp(logp[i, t] - b["old"][i, t]) for t in at]
        high = float(_loop_quantile([v.detach() for v in r], 0.7))
        low_logp = _loop_quantile([logp[i, t] for t in at], 0.25)
        for k, t in enumerate(at):
            total = total + (r[k] * b["A"][i, t]) * (float(r[k]) >= high) + 0.1 * b["A"][i, t] * low_logp
            count += 1
    return -total / count


@pytest.mark.parametrize("fused, sync_free", PATHS, ids=["fused", "plain", "sync_free"])
def test_the_loss_and_gradient_equal_a_float64_loop_over_each_responses_sorted_tokens(fused, sync_free):
    b = batch(5)
    lp = b["new"].clone().requires_grad_()
    want = reference(b, lp)
    (g_want,) = torch.autograd.grad(want, lp)
    loss_fn = CompiledLoss(dsl.parse(OBJECTIVE), fused=fused)
    loss_fn.sync_free = sync_free
    m = b["mask"]
    lp = dirty(b["new"], m).requires_grad_()
    loss, _ = loss_fn(lp, dirty(b["old"], m), dirty(b["A"], m), m)
    (g_got,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(loss.detach(), want.detach(), rtol=1e-12, atol=0), (loss, want)
    assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-16), (g_got - g_want).abs().max()
    assert (g_got[m] == 0).any() and (g_got[m] != 0).any()     # the mask acts on the batch


# ---------------------------------------------------------------- ranks, micro-batches and hosts
def test_it_needs_no_collective_and_nothing_from_other_micro_batches():
    """A response is whole in one loss call of every host: the loss asks for no batch or group, passes no
    process group to its reductions, and needs no BatchStatistics passes under accumulation."""
    for objective in (dsl.parse(OBJECTIVE), "cppo"):
        loss_fn = CompiledLoss(objective)
        assert loss_fn.inputs().keys() <= {"rollout_log_probs"} and loss_fn.batch_statistics() is None


def test_its_loss_is_the_same_under_a_data_parallel_process_group(monkeypatch):
    """Two ranks (a process group that records every collective): the loss and gradient are one rank's alone."""
    b = batch(5)
    calls = []

    def gradients(pg):
        lp = b["new"].clone().requires_grad_()
        loss, _ = CompiledLoss(dsl.parse(OBJECTIVE))(lp, b["old"], b["A"], b["mask"],
                                                     aggregation=Aggregation(process_group=pg))
        return loss.detach(), torch.autograd.grad(loss, lp)[0]
    alone = gradients(None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    ranked = gradients(lambda t: calls.append(t) or t)
    assert calls == [] and all(torch.equal(x, y) for x, y in zip(alone, ranked))


_VERL = """
import dsl
from openrlhf_drpo.hosts.verl import VerlObjectiveLoss
print(VerlObjectiveLoss(dsl.parse("r*A*seq_quantile(r, 0.5)")).inputs())
try:
    VerlObjectiveLoss("cppo")
except ValueError as e:
    print(e)
"""


@pytest.mark.parametrize("host", ["trl", "openrlhf", "verl"])
def test_each_host_gives_it_without_an_input_of_its_own_and_verl_refuses_cppos_rollout_by_name(host):
    if host == "verl":      # in verl's venv (tests/test_verl.py's)
        import os
        import subprocess
        from test_verl import ROOT, VERL_PYTHON
        assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run bash scripts/setup_verl.sh"
        proc = subprocess.run([str(VERL_PYTHON), "-c", _VERL], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.splitlines() == ["{}", "objective 'cppo' uses @anchor = rollout, but verl gives a policy "
                                            "loss none: verl's policy-loss call passes rollout IS weights, not "
                                            "rollout log-probs; use an objective on μ with verl's "
                                            "algorithm.rollout_correction instead"], proc.stdout
        return
    if host == "trl":
        from openrlhf_drpo.hosts.trl import TrlObjectiveLoss as Loss
    else:
        from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss as Loss
    assert Loss(dsl.parse("r*A*seq_quantile(r, 0.5)")).inputs() == {}
    assert set(Loss("cppo").inputs()) == {"rollout_log_probs"}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_no_path_syncs_with_the_host_on_the_path_cuda_takes(fused):
    """The per-row sort, the neighbours' gather and the tie masks read no value on the host (test_core's
    recorder): the sync-free path stays so."""
    from test_core import HostReads, SyncOps
    b = batch(3)
    loss_fn = CompiledLoss(dsl.parse(OBJECTIVE + " + 0.1*r*A*seq_quantile(r, 0.5)"), fused=fused)
    loss_fn.sync_free = True
    with HostReads() as reads, SyncOps(reads.seen):
        lp = b["new"].clone().requires_grad_()
        loss, metrics = loss_fn(lp, b["old"], b["A"], b["mask"])
        loss.backward()
        metrics.logged()
    assert reads.seen == []
