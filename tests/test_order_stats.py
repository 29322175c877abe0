"""The fourth version's order statistics (group_max, group_min, batch_quantile) and the two library
objectives built on them (top_entropy, passk_max): values and gradients against torch's own
(torch.quantile, torch.amax), the parser's refusals, levels and locality, the hosts' inputs, the
analysis's statement, and each objective against an independent float64 reference written from its
source (TRL 1.16.0's get_high_entropy_mask; PKPO's max@k score at k = n), on every path."""
import math

import pytest
import torch

import dsl
from openrlhf_drpo.core.reductions import NAMESPACE
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report
from openrlhf_drpo.core import CompiledLoss
from test_library_v3 import PATHS, batch, host_ratio, ours, ppo, theirs, token_mean

F64 = torch.float64
HELPERS = {"torch": torch, "math": math, **NAMESPACE}


def helper(name, x, m, *args):
    return HELPERS[f"_{name}"](x, m, x, *args)


def junk_where_masked(x, m):
    return torch.where(m, x, torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype).repeat(x.numel())[
        : x.numel()].view_as(x))


# ---------------------------------------------------------------- torch's own
@pytest.mark.parametrize("q", [0.0, 0.25, 0.3, 0.5, 0.8, 1.0])
def test_batch_quantile_is_torch_quantile_of_the_unmasked_tokens_bit_for_bit_and_in_its_gradient(q):
    g = torch.Generator().manual_seed(1)
    x, m = torch.randn(4, 7, generator=g, dtype=F64), torch.rand(4, 7, generator=g) > 0.3
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = helper("batch_quantile", junk_where_masked(ours_x, m), m, None, "token", q)
    want = torch.quantile(theirs_x[m], q)
    assert torch.equal(got, want.expand_as(x))
    (g_ours,), (g_theirs,) = torch.autograd.grad(got[0, 0], ours_x), torch.autograd.grad(want, theirs_x)
    assert torch.equal(g_ours, g_theirs)        # (1 − f, f) on the two neighbours, nothing on a masked token


def test_batch_quantile_interpolates_as_torch_quantile_bit_for_bit_at_every_weight():
    """torch.quantile's lerp, not a + f·(b − a) (they differ in the last bit for f ≥ 1/2)."""
    g = torch.Generator().manual_seed(2)
    x, m = torch.randn(8, 9, generator=g, dtype=F64) * 1e3, torch.rand(8, 9, generator=g) > 0.2
    for q in torch.rand(300, generator=g, dtype=F64).tolist():
        assert torch.equal(helper("batch_quantile", x, m, None, "token", q)[0, 0], torch.quantile(x[m], q)), q


def test_a_tied_quantile_gives_each_value_torch_quantiles_total_shared_equally_among_its_ties():
    """torch.quantile sends the weights to the sorted positions, so to whichever tie its sort puts there;
    here the tokens attaining a neighbour share it (as torch.amax's ties do): the same total per value."""
    x = torch.tensor([[2.0, 1.0, 1.0, 3.0, 1.0, 2.0]], dtype=F64)
    m = torch.ones_like(x, dtype=torch.bool)
    for q in (0.1, 0.5, 0.7, 0.9):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = helper("batch_quantile", a, m, None, "token", q)
        want = torch.quantile(b[0], q)
        assert torch.equal(got[0, 0], want)
        (ga,), (gb,) = torch.autograd.grad(got[0, 0], a), torch.autograd.grad(want, b)
        for v in (1.0, 2.0, 3.0):
            ties = x == v
            assert torch.allclose(ga[ties].sum(), gb[ties].sum(), rtol=1e-15), (q, v)
            assert torch.all(ga[ties] == ga[ties][0]), (q, v)          # shared equally


def test_group_max_and_min_share_the_gradient_among_ties_as_amax_does_not_as_max_with_dim():
    x = torch.tensor([[3.0], [1.0], [3.0], [0.0], [5.0]], dtype=F64).expand(5, 2).clone()
    m = torch.ones_like(x, dtype=torch.bool)
    group = torch.tensor([0, 0, 0, 0, 4])        # each response's group's first response
    for name, pick in (("group_max", torch.amax), ("group_min", torch.amin)):
        a = x.clone().requires_grad_()
        got = helper(name, a, m, group, "response")
        (grad,) = torch.autograd.grad(got[0, 0], a)
        b = x[:4, 0].clone().requires_grad_()
        (want,) = torch.autograd.grad(pick(b, 0), b)
        assert torch.allclose(grad[:4].sum(-1), want) and not grad[4].any(), (name, grad)
    b = x[:4, 0].clone().requires_grad_()
    (by_index,) = torch.autograd.grad(torch.max(b, 0).values, b)
    assert by_index.tolist() == [1.0, 0.0, 0.0, 0.0]      # max(dim) gives it to one tie: not followed


def test_an_empty_batch_or_group_reduces_to_zero_and_a_nan_element_makes_the_quantile_nan():
    x = torch.tensor([[0.5, math.nan, 2.0]], dtype=F64)
    none = torch.zeros_like(x, dtype=torch.bool)
    assert not helper("batch_quantile", x, none, None, "token", 0.5).any()
    assert not helper("group_max", x, none, torch.tensor([0]), "token").any()
    assert helper("batch_quantile", x, torch.ones_like(none), None, "token", 0.5).isnan().all()
    assert torch.equal(torch.quantile(x[0], 0.5), torch.tensor(math.nan, dtype=F64)) or \
        torch.quantile(x[0], 0.5).isnan()


def test_batch_quantile_over_several_data_parallel_ranks_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    x = torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="batch_quantile over data-parallel ranks is not supported"):
        helper("batch_quantile", x, x > 0, object(), "token", 0.5)


# ---------------------------------------------------------------- the language
@pytest.mark.parametrize("text, message, col", [
    ("r*A*batch_quantile(r, H)", "batch_quantile's argument 2 must be a constant, got 'H'", 23),
    ("r*A*batch_quantile(r, batch_mean(A))", "batch_quantile's argument 2 must be a constant", 23),
    ("r*A*batch_quantile(r, 1.5)", "batch_quantile's argument 2 '1.5' is 1.5, outside [0, 1]", 23),
    ("r*A*batch_quantile(r, -0.1)", "batch_quantile's argument 2 '-0.1' is -0.1, outside [0, 1]", 23),
    ("r*A*batch_quantile(r)", "batch_quantile() takes 2 arguments, got 1", 5),
    ("r*A*batch_max(r)", "'batch_max' is not a function of the language", 5),
    ("r*A*seq_quantile(r, H)", "seq_quantile's argument 2 must be a constant, got 'H'", 21),
    ("r*A*seq_quantile(r, seq_mean(A))", "seq_quantile's argument 2 must be a constant", 21),
    ("r*A*seq_quantile(r, r)", "seq_quantile's argument 2 must be a constant, got 'r'", 21),
    ("r*A*seq_quantile(r, 1.5)", "seq_quantile's argument 2 '1.5' is 1.5, outside [0, 1]", 21),
    ("r*A*seq_quantile(r, 0.5 - 1)", "seq_quantile's argument 2 '0.5 - 1' is -0.5, outside [0, 1]", 21),
    ("r*A*seq_quantile(r)", "seq_quantile() takes 2 arguments, got 1", 5),
    ("r*A*seq_quantile(r, 0.5, 0.9)", "seq_quantile() takes 2 arguments, got 3", 5),
    ("r*A*seq_median(r)", "'seq_median' is not a function of the language", 5),     # (not 'did you mean seq_mean')
])
def test_q_is_a_constant_in_the_unit_interval_else_a_located_error(text, message, col):
    with pytest.raises(dsl.DslError) as e:
        dsl.parse(text, "q.dsl")
    shown = str(e.value)
    assert shown.startswith(f"q.dsl:1:{col}: error: {message}") and "^" in shown, shown


@pytest.mark.parametrize("name, line, op", [("top_entropy", "13", "batch_quantile"), ("cppo", r"\d+", "seq_quantile")])
def test_q_set_from_outside_is_checked_as_the_files_own(name, line, op):
    assert dsl.load(name, params={"q": 0.5}).params["q"] == 0.5
    with pytest.raises(dsl.DslError, match=rf"{name}.dsl:{line}:\d+: error: {op}'s argument 2 'q' is 1.2"):
        dsl.load(name, params={"q": 1.2})


@pytest.mark.parametrize("text, level, locality, width, whole", [
    ("r*A*group_max(r)", "token", "group", "group", ("groups",)),
    ("r*A*group_min(seq_mean(r))", "response", "group", "group", ("groups",)),
    ("r*group_max(seq_mean(A))", "response", "token", "token", ("groups",)),
    ("r*A*batch_quantile(r, 0.3)", "batch", "batch", "batch", ("batch",)),
    ("r*A*[H >= batch_quantile(H, 0.8)]", "batch", "batch", "token", ("batch",)),
])
def test_each_statistic_has_its_level_and_its_objectives_locality(text, level, locality, width, whole):
    obj = dsl.parse(text)
    node = next(n for n in obj.expr.walk() if n.op in ("group_max", "group_min", "batch_quantile"))
    assert obj.facts.level[node] == level
    assert (obj.facts.locality, obj.facts.gradient_width, obj.facts.kept_whole) == (locality, width, whole)


# ---------------------------------------------------------------- the library objectives, by their sources
def top_entropy(b, logp, H, q=0.8, eps=0.2):
    # TRL 1.16.0 GRPOTrainer.get_high_entropy_mask (threshold = 1 − top_entropy_quantile): torch.quantile of the
    # unmasked tokens' entropies, kept where entropies·mask ≥ it, and mask; the loss PPO's, its token mean
    m = b["m"].bool()
    threshold = torch.quantile(H.detach()[m], q)
    keep = ((H.detach() * b["m"] >= threshold) & m).to(F64)
    return token_mean(-ppo(host_ratio(logp, b["old"]), b["A"], eps, eps) * keep, b["m"])


def passk_max(b, logp, H, eps=0.2):
    # PKPO at k = n: every sample's score is the group's largest f, f = the response's (mean) advantage
    m, groups = b["m"], b["groups"].tolist()
    n = m.sum(-1)
    f = [float((b["A"][i] * m[i]).sum() / n[i]) if n[i] > 0 else None for i in range(len(groups))]
    best = [max((f[j] for j in range(len(groups)) if groups[j] == groups[i] and f[j] is not None), default=0.0)
            for i in range(len(groups))]
    score = torch.tensor(best, dtype=F64)[:, None].expand_as(logp)
    return token_mean(-ppo(host_ratio(logp, b["old"]), score, eps, eps), m)


@pytest.mark.parametrize("fused, sync_free", PATHS, ids=["fused", "plain", "sync_free"])
@pytest.mark.parametrize("reference", [top_entropy, passk_max], ids=lambda f: f.__name__)
def test_each_order_statistic_objective_equals_its_sources_formula_in_loss_and_gradient(reference, fused, sync_free):
    b = batch(0)
    expected, got = theirs(reference, b), ours(reference.__name__, b, fused, sync_free)
    assert torch.allclose(got[0], expected[0], rtol=1e-12, atol=1e-15), (got[0], expected[0])
    assert torch.allclose(got[1], expected[1], rtol=1e-10, atol=1e-15), (got[1] - expected[1]).abs().max()
    assert got[2] is None or not got[2].any()       # H enters a condition only


@pytest.mark.parametrize("name, undone", [("top_entropy", dict(q=0)), ("passk_max", dict(ε=1000))])
def test_the_mask_and_the_clip_act_on_the_test_batch(name, undone):
    b = batch(0)
    (l0, g0, _), (l1, g1, _) = ours(name, b), ours(name, b, **undone)
    assert not torch.allclose(g0, g1) and not torch.allclose(l0, l1)
    if name == "top_entropy":       # q = 0 keeps every token: PPO's own loss
        keep_all = theirs(lambda c, lp, h: token_mean(-ppo(host_ratio(lp, c["old"]), c["A"]), c["m"]), b)
        assert torch.allclose(l1, keep_all[0], rtol=1e-12) and torch.allclose(g1, keep_all[1], rtol=1e-10)


# ---------------------------------------------------------------- hosts and the analysis
@pytest.mark.parametrize("name, key, used", [("top_entropy", "batch", "batch_quantile"),
                                             ("passk_max", "groups", "group_max")])
def test_a_host_that_does_not_hold_the_whole_batch_or_group_is_refused_naming_the_statistic(name, key, used):
    assert used in CompiledLoss(name).inputs()[key]
    host = type("HostLoss", (CompiledLoss,), {"host": "Host", "provides": {"entropy": "it gives H"}})
    with pytest.raises(ValueError, match=rf"objective '{name}' uses {used} \("):
        host(name)


def test_a_quantile_of_a_on_a_held_group_with_spread_advantages_is_a_located_error_naming_the_fix(tmp_path, capsys):
    from openrlhf_drpo.cli import analyze_main
    path = tmp_path / "q.dsl"
    path.write_text("r*A*batch_quantile(seq_mean(A), 0.5)\n", encoding="utf-8")
    assert analyze_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:1:5: error: batch_quantile of a value that reads A is not analysed on a held "
                          "group whose advantages differ"), err
    assert "hint: hold the group's advantages equal (--group 1,1,1,1,1,1,1,1), or read A outside it" in err, err
    assert analyze_main(["--group", "1,1,1,1", str(path)]) == 0         # held equal: analysed


@pytest.mark.parametrize("name, said", [("top_entropy", "batch_quantile(x, q) = x"),
                                        ("r*A - (r - group_min(seq_mean(r)))^2", "group_min(x) = x"),
                                        ("passk_max", "on the held group (advantages A·(1, 1, 1, 1, 0, 0, 0, 0)) Â = max(0, A)")])
def test_the_analysis_holds_each_statistic_on_the_uniform_batch_and_says_so(name, said):
    obj = dsl.load(name) if name in dsl.shipped_names() else dsl.parse(name, "x.dsl")
    text = " ".join(report(analyze(obj), width=None).split())
    assert said in text, text


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("name", ["top_entropy", "passk_max", "r*A*batch_quantile(seq_mean(r), 0.3) + group_min(r)"])
def test_no_path_syncs_with_the_host_on_the_path_cuda_takes(name, fused):
    """The quantile's sort, its neighbours' gather and the group extremes read no value on the host
    (test_core's recorder): the sync-free path stays so."""
    from test_core import HostReads, SyncOps
    b = batch(3)
    obj = dsl.load(name) if name in dsl.shipped_names() else dsl.parse(name, "x.dsl")
    loss_fn = CompiledLoss(obj, fused=fused)
    loss_fn.sync_free = True
    with HostReads() as reads, SyncOps(reads.seen):
        lp, h = b["new"].clone().requires_grad_(), b["H"].clone().requires_grad_()
        loss, metrics = loss_fn(lp, b["old"], b["A"], b["mask"], entropy=h, groups=b["groups"])
        loss.backward()
        metrics.logged()
    assert reads.seen == []


def test_an_order_statistic_over_an_optimizer_step_of_several_micro_batches_is_refused_by_name():
    # BatchStatistics' no-grad passes sum each micro-batch's statistics; a quantile is not a sum of parts
    from openrlhf_drpo.core.collectives import BatchStatistics
    with pytest.raises(ValueError, match=r"batch_quantile over an optimizer step of several micro-batches is not "
                                         r"supported.*gradient_accumulation_steps=1"):
        CompiledLoss("top_entropy").batch_statistics()
    assert isinstance(CompiledLoss("trust_the_batch").batch_statistics(), BatchStatistics)
