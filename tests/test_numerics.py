"""Numerics in the dtypes people train in: every shipped objective's fused kernels (the CPU's eager
kernel and the sync-free kernels CUDA runs, uncompiled here) on fp32 and bf16 log-probs, against
the plain path in float64 on the same (rounded) inputs; and the metrics at log-ratios from -800 to
+800.

Tolerances, relative to the largest float64 gradient (max |g|), and for the loss to the float64
aggregate of |ℓ| (the loss with every per-token term made positive, so a loss whose terms cancel
is not held to a relative error it cannot have):
- fp32: 1e-5 (measured on this batch: at most 6e-7, GMPO);
- bf16 log-probs (computed in fp32, the gradient returned in bf16): 2^-8 + 1e-5, half a bf16 unit
  in the last place of the largest gradient (the gradient's own rounding; measured 3.7e-3);
  the loss (fp32) 1e-5.
The metrics to 1e-5 relative (1e-6 absolute). Every loss, gradient and metric is finite."""
import dataclasses
import math
import pathlib
import sys

import pytest
import torch
from extra_inputs import extra_inputs, r_analysed

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))
from gpu_check import edge_batch as gpu_edge_batch     # noqa: E402  (a script's folder, not a package)

import dsl
from openrlhf_drpo.core import CompiledLoss
from openrlhf_drpo.core.kernels import RATIO_RANGE, aggregation_coef

SHIPPED = dsl.shipped_names()
# ∂ℓ/∂log π is the whole gradient (a vocabulary sum's is the support's: tests/test_vocabulary.py)
THROUGH_LOG_PI = r_analysed(SHIPPED)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAD_TOL = {"fp32": 1e-5, "bf16": 2 ** -8 + 1e-5}
LOSS_TOL = 1e-5
PATHS = ["eager", "sync_free"]


def edge_batch(seed=0, B=6, T=16):
    """Ordinary tokens, and the issue's edges: log-ratios +40, -30 and +25.5 (the ratio clamp
    active), r exactly 1 (a token, and a whole response), A = 0, an empty response, all exact in
    bf16: benchmarks/gpu_check.py's batch (the one the GPU check runs), in a smaller shape."""
    return gpu_edge_batch(B, T, seed)[:4]


def rounded(dtype, new, old, A, rollout):
    """The inputs a trainer would give in `dtype` (log-probs in it, advantages fp32), and the same
    values in float64 for the reference."""
    low = [new.to(dtype), old.to(dtype), A.float(), rollout.to(dtype)]
    return low, [x.double() for x in low]


def run(loss_fn, new, old, A, mask, rollout, extras=None):
    """(loss, ∂loss/∂log π, metrics); with the third version's inputs the objective reads (the same
    values for a reference in float64: extras, as low-precision ones, widened)."""
    lp = new.clone().requires_grad_()
    given = extra_inputs(loss_fn, new) if extras is None else widened(extras, new.dtype)
    loss, metrics = loss_fn(lp, old, A, mask, rollout_log_probs=rollout, **given)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics.values


def widened(extras, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in extras.items()}


def fused(name, path):
    loss_fn = CompiledLoss(name)
    loss_fn.sync_free = path == "sync_free"     # the kernels CUDA takes, on the CPU
    return loss_fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", THROUGH_LOG_PI)
def test_every_fused_kernel_gives_the_float64_loss_and_gradient_in_fp32_and_bf16(name, path, dtype):
    new, old, A, mask = edge_batch()
    (lp, lo, a, ro), ref_inputs = rounded(DTYPES[dtype], new, old, A, old - 0.1 * A.abs() - 0.05)
    reference = CompiledLoss(name, fused=False)
    extras = extra_inputs(reference, lp)       # in the low precision: the reference gets the same values
    ref_loss, ref_grad, ref_metrics = run(reference, *ref_inputs[:3], mask, ref_inputs[3], extras)
    loss, grad, metrics = run(fused(name, path), lp, lo, a, mask, ro, extras)
    assert grad.dtype == DTYPES[dtype]
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(metrics).all()
    largest = ref_grad.abs().max().item()
    assert largest > 0
    error = (grad.double() - ref_grad).abs().max().item() / largest
    assert error <= GRAD_TOL[dtype], (error, GRAD_TOL[dtype])
    # the aggregate of |ℓ|, in float64, as the loss aggregates ℓ
    r_lp, r_old, r_a, r_ro = ref_inputs     # (π_old is μ here)
    given = widened(extras, torch.float64)        # the generated code's TokenBatch, as CompiledLoss builds it
    b = dataclasses.replace(reference.batch(r_lp, r_old, r_a, mask, rollout_log_probs=r_ro, **given), anchor=r_old)
    per_token = reference.generated.value(b, mask)
    coef, count = aggregation_coef(mask.double(), reference.aggregate)
    magnitude = (torch.where(mask, per_token.abs(), 0.0) * coef).sum().item() / max(count.sum().item(), 1)
    assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL * magnitude, (loss.item(), ref_loss.item(), magnitude)
    assert torch.allclose(metrics.double(), ref_metrics, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- metrics at extreme log-ratios
EXTREMES = [-800.0, -110.0, -90.0, -30.0, 30.0, 90.0, 800.0]
# objectives that read log π − log μ but never the clamped r: their metrics' ratio comes unclamped
# from the generated code (a sequence ratio for GSPO, GMPO, ...)
RAW_RATIO = [n for n in THROUGH_LOG_PI if "r" not in dsl.load(n).names()]
# objectives whose own value overflows past a log-ratio of 88.7 in fp32 (709.8 in float64), and whose
# gradient underflows below -87: they read exp(log π − log μ) unclamped
# (trust_the_batch: its batch ESS reads every w, so one inf w makes the loss NaN; FeynRL falls back to
# ESS = 1 there, which the file does not write; seq_tis: its weight e^(Σ_t log π − log π_rollout) is
# unclamped, as prime-rl's PR writes it, so 0 in fp32 where float64's is 1e-48)
# (gspo_turn: its turn's mean over extra_inputs' three tokens, where GSPO's over twelve stays below 88.7;
# areal_prox: its behaviour weight times its ratio is e^(log π − log μ), unclamped, AReaL's own)
OVERFLOWING = {"kpop", "opsm", "pspo", "trust_the_batch", "seq_tis", "gspo_turn", "areal_prox"}


def far_batch(B=8, T=12, seed=1):
    """Ordinary responses, each with one token at a log-ratio of EXTREMES (the larger of log π and
    log μ at -4: every value exact in bf16), and an empty response."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    new = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[-1] = False
    for b, x in enumerate(EXTREMES):
        new[b, 3], old[b, 3] = (-4.0, -4.0 - x) if x > 0 else (-4.0 + x, -4.0)
    return new, old, A, mask


def in_range(name, mask):
    """The mask, without (for OVERFLOWING) the responses where e^(log π − log μ) leaves fp32's
    normal range: the objective's own value overflows there (inf), or its gradient underflows to 0
    where float64's is 1e-48 (nothing a metric of it could mend)."""
    if name not in OVERFLOWING:
        return mask
    far = torch.tensor([abs(x) >= 88 for x in EXTREMES] + [False] * (mask.shape[0] - len(EXTREMES)))
    return mask & ~far[:, None]


def test_the_far_batch_holds_every_extreme_log_ratio():
    new, old, _, mask = far_batch()
    for dtype in DTYPES.values():
        raw = (new.to(dtype).double() - old.to(dtype).double())[:, 3]
        assert raw[:len(EXTREMES)].tolist() == EXTREMES and RAW_RATIO


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", THROUGH_LOG_PI)
def test_metrics_are_finite_and_equal_their_float64_values_at_log_ratios_to_800(name, path, dtype):
    """'Meaningful': each metric equals its float64 value, where the metrics' ratio is
    exp(clamp(log π − log μ, ±20)) for every objective (kernels.RATIO_RANGE), as OpenRLHF clamps
    the ratio; so w = (∂ℓ/∂log π)/(r·A) is finite at any finite log-ratio where ∂ℓ/∂log π is.
    Before, an objective that never reads r (GSPO, GMPO, PSPO, ...) took it unclamped: one token
    at a log-ratio of -90 made GSPO's w_mean 1e28-1e33 in fp32, one at -110 inf, one at -800 inf
    or NaN. Every loss and gradient is finite too, except that
    KPOP, OPSM and PSPO overflow themselves (their unclamped e^90 in fp32): for them the responses
    at |log-ratio| >= 90 are left out (in_range)."""
    new, old, A, mask = far_batch()
    (lp, lo, a, ro), ref_inputs = rounded(DTYPES[dtype], new, old, A, old - 0.05)
    mask = in_range(name, mask)
    reference = CompiledLoss(name, fused=False)
    extras = extra_inputs(reference, lp)       # in the low precision: the reference reads the same π_ref
    _, _, ref_metrics = run(reference, *ref_inputs[:3], mask, ref_inputs[3], extras)
    loss, grad, metrics = run(fused(name, path), lp, lo, a, mask, ro, extras)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.isfinite(metrics).all() and torch.isfinite(ref_metrics).all(), (metrics, ref_metrics)
    assert torch.allclose(metrics.double(), ref_metrics, rtol=1e-4, atol=1e-6), (metrics, ref_metrics)
    assert metrics[4] <= RATIO_RANGE[1] * (1 + 1e-6)       # the largest ratio: at most e^20


@pytest.mark.parametrize("name", RAW_RATIO)
def test_w_mean_of_a_raw_ratio_objective_is_the_autograd_weight_over_tokens_within_the_ratio_clamp(name):
    """drpo_w_mean, independently: the mean, over unmasked tokens with A ≠ 0 whose log-ratio is
    within ±20 (where the loss's r is not clamped; beyond it an objective on the raw ratio has
    w = ∂ℓ/∂log π over an e^±800 no double holds), of the per-token gradient (float64 autograd of
    the plain path, per unit of aggregation weight) over r·A, against the fp32 fused kernel's."""
    new, old, A, mask = far_batch()
    rollout = old - 0.05
    mask = in_range(name, mask)
    loss_fn = CompiledLoss(name, fused=False)
    _, grad, _ = run(loss_fn, new, old, A, mask, rollout)
    coef, count = aggregation_coef(mask.double(), loss_fn.aggregate)
    count = count.sum().clamp(min=1)            # the count the loss divides by
    per_token = -grad * count / torch.where(coef != 0, coef, 1.0)      # ∂ℓ/∂log π per unit weight
    raw = new - (rollout if loss_fn.anchor == "rollout" else old)       # μ is the objective's anchor (oapl's: rollout)
    has_w = mask & (A != 0) & (raw.abs() <= 20)
    assert (mask & (A != 0) & (raw.abs() > 20)).any()        # the far tokens are there, and left out
    expected = (per_token / (torch.exp(raw) * A))[has_w].mean().item()
    fused_fn = CompiledLoss(name)
    fused_fn(new.float().requires_grad_(), old.float(), A.float(), mask, rollout_log_probs=rollout.float(),
             **extra_inputs(fused_fn, new.float()))
    got = fused_fn.metrics.w_mean.item()
    assert math.isfinite(expected) and math.isclose(got, expected, rel_tol=1e-4), (got, expected)
