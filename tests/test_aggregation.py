"""Weights, aggregation and metrics (issue 36, item 4): host weights selected by the mask as every
other input; drpo_w_mean the objective's own, on every path, whatever weights a host passes; the
four @aggregate modes as verl 0.9.1's own agg_loss computes them (run in its venv). OpenRLHF 0.11.2's
aggregate_loss has token-mean and seq-mean-token-mean only (token_level_loss), which
tests/test_loss.py holds ours to."""
import json
import math

import pytest
import torch
from test_verl import verl_python

import dsl
from openrlhf_drpo.core import Aggregation, CompiledLoss
from openrlhf_drpo.core.kernels import aggregation_coef

F64 = torch.float64
PATHS = {"plain": dict(fused=False), "fused": dict(fused=True), "sync_free": dict(fused=True, sync_free=True)}
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def build(spec, path, **kw):
    loss_fn = CompiledLoss(spec, fused=PATHS[path]["fused"], **kw)
    loss_fn.sync_free = PATHS[path].get("sync_free", False)
    return loss_fn


def batch(seed=0, B=4, T=6):
    """Per-response advantages, one masked tail, 0/1 host weights that differ within responses."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    new = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    A = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    weights = (torch.rand(B, T, generator=g) > 0.4).to(F64)
    return new, old, A, mask, weights


def call(loss_fn, new, old, A, mask, **kw):
    lp = new.clone().requires_grad_()
    loss, metrics = loss_fn(lp, old, A, mask, **kw)
    return loss.detach(), torch.autograd.grad(loss, lp)[0], metrics.floats()


# ---------------------------------------------------------------- host weights
@pytest.mark.parametrize("junk", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_a_non_finite_host_weight_in_a_masked_slot_changes_nothing(name, path, junk):
    new, old, A, mask, weights = batch()
    clean = call(build(name, path), new, old, A, mask, aggregation=Aggregation(weights=weights))
    dirty = call(build(name, path), new, old, A, mask,
                 aggregation=Aggregation(weights=torch.where(mask, weights, junk)))
    assert math.isfinite(dirty[0]) and torch.isfinite(dirty[1]).all()
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1]) and dirty[2] == clean[2]


def own_w_mean(name, new, old, A, mask):
    """drpo_w_mean by its definition, independently of the kernels: over unmasked tokens with A ≠ 0, the
    float64 autograd gradient of the plain path without host weights, per unit of aggregation weight,
    over r·A (r = e^(log π − log μ); every log-ratio here is within ±20)."""
    loss_fn = CompiledLoss(name, fused=False)
    _, grad, _ = call(loss_fn, new, old, A, mask)
    coef, count = aggregation_coef(mask.to(F64), loss_fn.aggregate)
    per_unit = -grad * count.sum().clamp(min=1) / torch.where(coef != 0, coef, 1.0)
    has_w = mask & (A != 0)
    return (per_unit / (torch.exp(new - old) * A))[has_w].mean().item()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["gspo", "gmpo", "ppo", "drpo"])
def test_w_mean_is_the_objectives_own_under_any_host_weights_on_every_path(name, path):
    """GSPO gave 0.0189 fused and 0.2800 plain under 0/1 weights: the fused path divided a spread
    gradient by the token's weighted coefficient (by 1 where the weight is 0)."""
    new, old, A, mask, weights = batch()
    expected = own_w_mean(name, new, old, A, mask)
    for w in (weights, 3.0 * weights + 0.5):
        got = call(build(name, path), new, old, A, mask, aggregation=Aggregation(weights=w))[2]["drpo_w_mean"]
        assert math.isclose(got, expected, rel_tol=1e-12), (got, expected)


# ---------------------------------------------------------------- the aggregation modes, by the hosts' code
VERL_AGG = """
import json, torch
from verl.trainer.ppo.core_algos import agg_loss
d = json.loads({data!r})
loss_mat = torch.tensor(d["loss"], dtype=torch.float64, requires_grad=True)
# a float mask: with a bool one, the length + 1e-8 of seq-mean-token-mean is float32 (the 1e-8 vanishes;
# the verl adapter passes verl's 1/length itself)
mask = torch.tensor(d["mask"], dtype=torch.float64)
out = {{}}
for mode in {modes!r}:
    loss = agg_loss(loss_mat, mask, mode)
    grad, = torch.autograd.grad(loss, loss_mat)
    out[mode] = [loss.item(), grad.tolist()]
print(json.dumps(out))
"""


def ours(mode, new, old, A, mask, path):
    """(loss, d loss/d ℓ) of r·A at r = 1 (log π = log μ), where ℓ = A and dℓ/d log π = A."""
    loss, grad, _ = call(build(dsl.parse(f"@aggregate = {mode}\nr*A"), path), new, old, A, mask)
    return loss.item(), grad / A


def verl_batch():
    """A 3-token response of ℓ = 1 (verl: −3 in the token-sum mode), responses of other lengths, an
    empty one; T = 5."""
    A = torch.tensor([[1.0, 1.0, 1.0, 5.0, 5.0], [0.5, -2.0, 3.0, 1.5, -1.0], [2.0, 7.0, 7.0, 7.0, 7.0],
                      [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    old = torch.full_like(A, -1.0)
    return old.clone(), old, A, mask


@pytest.fixture(scope="module")
def verl_agg():
    _, _, A, mask = verl_batch()
    code = VERL_AGG.format(data=json.dumps({"loss": (-A).tolist(), "mask": mask.tolist()}), modes=MODES)
    proc = verl_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_every_aggregate_mode_is_verls_agg_loss(mode, path, verl_agg):
    loss, coef = ours(mode, *verl_batch(), path)
    theirs, their_coef = verl_agg[mode]
    assert math.isclose(loss, theirs, rel_tol=1e-15), (loss, theirs)
    torch.testing.assert_close(coef, -torch.tensor(their_coef, dtype=F64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_the_token_sum_mode_of_a_three_token_response_of_ones_is_exactly_three(path):
    new, old, A, mask = verl_batch()
    loss, _ = ours("seq-mean-token-sum", new[:1], old[:1], torch.ones_like(A[:1]), mask[:1], path)
    assert loss == -3.0


# ---------------------------------------------------------------- an overflowing branch that min and clip drop
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rollout", [False, True], ids=["", "rollout_given"])
@pytest.mark.parametrize("T", [6, 8])
def test_gspo_is_finite_in_fp32_where_its_unclipped_branch_overflows(path, rollout, T):
    """One token at a log-ratio of +800 in a six- or eight-token response (issue 46's case 8: one of 8,
    rollout log-probs given): s = e^133 or e^100, inf in fp32 (finite in float64), and min(s·A, clip(s)·A)
    takes the clipped branch, whose gradient is 0. The unclipped branch's derivative (inf) met 0 there:
    the gradient and drpo_w_mean were NaN on every path."""
    old = torch.full((2, T), -1.0, dtype=F64)
    new = old + 0.02 * torch.arange(2 * T, dtype=F64).view(2, T)
    new[0, 0], old[0, 0] = -4.0, -804.0
    A = torch.tensor([[1.0], [-0.5]], dtype=F64).expand(2, T)
    out = {}
    for dtype in (torch.float32, F64):
        given = dict(rollout_log_probs=(old - 0.05).to(dtype)) if rollout else {}
        out[dtype] = call(build("gspo", path), new.to(dtype), old.to(dtype), A.to(dtype), None, **given)
    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = out[torch.float32], out[F64]
    assert torch.isfinite(grad).all() and all(map(math.isfinite, metrics.values()))
    assert grad[0].abs().max() == 0 and ref_grad[0].abs().max() == 0
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-6)
    assert all(math.isclose(metrics[k], ref_metrics[k], rel_tol=1e-5, abs_tol=1e-7) for k in metrics), (metrics,
                                                                                                     ref_metrics)


# ---------------------------------------------------------------- the global normalizer, a checked contract
BAD_NORMS = {
    "negative": (-4.0, r"aggregation.norm is -4.0: it must be finite and > 0"),       # flipped the loss silently
    "negative_tensor": (torch.tensor(-4.0, dtype=F64), r"aggregation.norm is -4.0: it must be finite and > 0"),
    "per_response": (torch.full((4,), 9.0, dtype=F64), r"aggregation.norm is \[4\]: the global normalizer is one "
                                                       r"number \(0-d\).*Aggregation\(weights=...\)"),
    "nan": (math.nan, r"aggregation.norm is nan"),
    "inf": (torch.tensor(math.inf), r"aggregation.norm is inf"),
    "bool": (torch.tensor(True), r"aggregation.norm is torch.bool"),
    "string": ("24", r"aggregation.norm must be a number or a 0-d tensor, got str"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", BAD_NORMS)
def test_a_normalizer_that_is_not_one_finite_positive_number_is_refused_naming_it(case, path):
    """norm = -4 flipped the loss and its update without a word; a [B] norm gave a raw torch error on two
    paths and a non-scalar loss on the sync-free one. Each is refused at the tensor boundary, by name."""
    new, old, A, mask, _ = batch()
    norm, match = BAD_NORMS[case]
    with pytest.raises((ValueError, TypeError), match=match):
        call(build("gspo", path), new, old, A, mask, aggregation=Aggregation(norm=norm))


@pytest.mark.parametrize("path", PATHS)
def test_a_zero_normalizer_on_a_step_with_tokens_is_refused_on_every_path_the_sync_free_one_without_a_host_sync(path):
    """A zero normalizer with a mask: the sync-free (CUDA) path checks it by an asynchronous device assert
    (reading the mask's values would sync the host), the others on the host; a 0-d tensor on the host is
    read at no cost."""
    new, old, A, mask, _ = batch()
    for norm in (0.0, torch.zeros((), dtype=F64)):
        with pytest.raises((ValueError, RuntimeError), match="aggregation.norm is 0 on a step with tokens"):
            call(build("ppo", path), new, old, A, mask, aggregation=Aggregation(norm=norm))


@pytest.mark.parametrize("path", PATHS)
def test_a_zero_normalizer_is_accepted_where_the_step_has_no_token(path):
    """The step's count is 0 only where no rank has a token (verl's (mask.sum(-1) > 0).sum() of an empty
    step): accepted; every path gives loss 0 and gradient 0 (issue 46's case 4: the fused paths gave NaN)."""
    new, old, A, mask, _ = batch()
    for norm in (0.0, torch.zeros((), dtype=F64)):
        loss, grad, _ = call(build("ppo", path), new, old, A, torch.zeros_like(mask), aggregation=Aggregation(norm=norm))
        assert loss.item() == 0.0 and not grad.any(), (loss, grad)
