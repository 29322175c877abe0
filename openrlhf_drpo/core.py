"""The host-neutral loss core: a compiled objective as a torch loss, knowing no training framework.

    loss_fn = CompiledLoss("drpo", delta=0.2)     # shipped name, path or dsl.Objective
    loss, metrics = loss_fn(log_probs, old_log_probs, advantages, mask)
    loss.backward(); metrics.floats()             # {"drpo_w_mean": ..., ...}: one host sync

Inputs are per-token [B, T]: log π (with grad), μ's log-probs (π_old; π_rollout comes separately and
is the anchor where the objective says `@anchor = rollout`), advantages and a mask. How per-token terms
become the loss is one `Aggregation` (mode, global normalizer, per-token weights) that a host builds
and both paths (fused and plain) consume. The metrics come back as a `LossMetrics` record: named 0-d
views of one stacked tensor. Each host adapter (openrlhf_drpo.loss, .trl, .verl) maps its framework's
names onto these; this module imports torch, numpy, sympy and lark only."""
from __future__ import annotations

import functools
import math
import re
import types
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch
from torch import nn

import dsl
from dsl.codegen import compile_objective
from dsl.parser import OPTIONS, Objective

@dataclass(frozen=True)
class Metric:
    name: str            # the LossMetrics attribute
    key: str | None      # the name hosts log it under (None: read by the host adapter only)
    reduce: str          # how data-parallel ranks combine it: "mean", "max" or "sum"


# what the kernels compute, in order (_stats); drpo_filtered follows where the objective filters
METRICS = (Metric("w_mean", "drpo_w_mean", "mean"),
           Metric("past_boundary_diverging", "drpo_past_boundary_diverging", "mean"),
           Metric("past_boundary_converging", "drpo_past_boundary_converging", "mean"),
           Metric("abs_pi_minus_mu", "drpo_abs_pi_minus_mu", "mean"),
           Metric("ratio_max", "drpo_ratio_max", "max"),
           Metric("neg_log_ratio_mean", None, "mean"),     # OpenRLHF's ppo_kl: the masked mean of −log r
           Metric("tokens", None, "sum"))
FILTERED = Metric("filtered", "drpo_filtered", "mean")
METRIC_KEYS = tuple(m.key for m in METRICS if m.key)


class LossMetrics:
    """A call's metrics: named 0-d views (metrics.w_mean, ...) of one stacked tensor, so that
    reading them all is one host sync (floats()); each field declares its logged name and how
    ranks combine it (METRICS). They stay tensors until a host reads them."""

    def __init__(self, values: torch.Tensor, fields: tuple = METRICS):
        self.values, self.fields = values, fields

    def __getattr__(self, name):
        for i, m in enumerate(self.__dict__.get("fields", ())):
            if m.name == name:
                return self.values[i]
        raise AttributeError(f"LossMetrics has no metric {name!r}; it has {[m.name for m in self.fields]}")

    def logged(self) -> dict:
        """The logged metrics as {key: 0-d tensor}."""
        return {m.key: self.values[i] for i, m in enumerate(self.fields) if m.key}

    def floats(self) -> dict:
        """The logged metrics as {key: float}: one host sync."""
        return {m.key: x for m, x in zip(self.fields, self.values.tolist()) if m.key}

    def __repr__(self):
        return f"LossMetrics({', '.join(f'{m.name}={v:.6g}' for m, v in zip(self.fields, self.values.tolist()))})"


class LossOutput(NamedTuple):
    loss: torch.Tensor
    metrics: LossMetrics


@dataclass(frozen=True)
class Aggregation:
    """How per-token terms become the loss, one value that each host builds and the fused and the
    plain path both consume: loss = −Σ_t c_t·w_t·ℓ_t / N. `mode` (one of the language's
    @aggregate values; None: the objective's own) sets c_t and the local count N (unmasked tokens,
    or non-empty responses); `norm` replaces N by a global normalizer (the batch's tokens or
    responses over the data-parallel ranks); `weights` (detached, per token) are host factors
    in the sum, not the count (verl's rollout IS weights, TRL's per-response normalization)."""
    mode: str | None = None
    norm: float | torch.Tensor | None = None
    weights: torch.Tensor | None = None


def _aggregation_coef(m, mode):
    """(coef, count): d loss / d ℓ = −coef/count (ℓ the per-token objective; the loss is minus
    its aggregate), exactly as OpenRLHF's aggregate_loss scales it (m is the float mask), where
    a given normalizer (batch_num_tokens or global_batch_size, over dp_size) replaces count.
    Token mode divides by the token count; sample mode averages the per-sequence means over
    non-empty sequences. The token-sum modes weight each sequence's mean by its length (or
    length / T)."""
    if mode == "token-mean":
        return m, m.sum()
    count = m.sum(dim=-1, keepdim=True)
    per_seq = {"seq-mean-token-mean": 1.0, "seq-mean-token-sum": count,
               "seq-mean-token-sum-norm": count / m.shape[-1]}[mode] / (count + 1e-8)
    seq = (count > 0).to(m.dtype)
    return m * (per_seq * seq), seq.sum()


def _float_mask(action_mask, dtype):
    # on CPU a bool tensor converts ~4x slower than uint8, and a comparison into bool ~4x
    # slower than into float
    if action_mask.dtype == torch.bool:
        return action_mask.view(torch.uint8).to(dtype)
    return torch.ne(action_mask, 0, out=torch.empty_like(action_mask, dtype=dtype))


def _dot(x, y):
    return torch.dot(x.reshape(-1), y.reshape(-1))


def _mul_sum(x, y):
    return (x * y).sum()      # what inductor fuses into the loop (a dot is a separate BLAS call)


def _per_token(value_and_grad, logp, anchor, A, old, rollout, keep, coef):
    """The generated function's results, with its gradient per token as ∂ℓ/∂log π, and the
    gradient of Σ coef·ℓ (for an objective with a sequence reduction, which computes that one
    itself, ∂ℓ/∂log π is that over coef: the gradient a token gets per unit of its weight)."""
    value, grad, r, raw, mu, inside = value_and_grad(logp, anchor, A, old, rollout, keep, coef)
    if getattr(value_and_grad, "includes_coef", False):
        return value, grad / torch.where(coef != 0, coef, 1.0), grad, r, raw, mu, inside
    return value, grad, grad * coef, r, raw, mu, inside


def _kernel(value_and_grad, mode, logp, anchor, A, action_mask, norm, old=None, rollout=None, weights=None,
            dot=_dot):
    """The aggregated loss -Σ c·ℓ, its gradient -c·∂ℓ/∂log π (scale None: already applied)
    and the metric sums, in one function that torch.compile turns into a couple of fused
    loops. Every per-token quantity is selected by the mask before it is reduced, so masked
    slots never leak. With dot=_dot, loss and gradient equal _eager_kernel's bit for bit."""
    keep = action_mask != 0       # (.bool() here costs torch.compile on CPU a 1.6x slower kernel)
    m = keep.to(logp.dtype)
    coef, count = _aggregation_coef(m, mode)
    if weights is not None:
        coef = coef * weights      # a host's per-token weights (verl's rollout IS weights): in the sum, not the count
    value, grad, total, r, raw, mu, inside = _per_token(value_and_grad, logp, anchor, A, old, rollout, keep, coef)
    scale = -1 / (count.clamp(min=1) if norm is None else norm)     # all masked: 0/1, no gradient (OpenRLHF: 0/0)
    nonzero_A = torch.sign(A).abs()
    w = grad / (r * A + (1 - nonzero_A))      # w = (∂ℓ/∂log π)/(r·A), where A ≠ 0
    # w ≤ 0: the trust-region boundary is reached, unless the ratio clamp zeroed the gradient
    # (`inside` = 0: a numerical stop, not the objective's). The move's direction is the sign
    # of A·(log π − log μ) (0 where A = 0): +1 diverging, −1 converging. So with
    # s = stopped·direction on unmasked tokens, Σs = diverging − converging and Σs² = their sum.
    s = torch.where(keep, (1 - torch.relu(torch.sign(w))) * inside * torch.sign(raw * A), 0.0)
    nonzero_A = torch.where(keep, nonzero_A, 0.0)
    sel = functools.partial(torch.where, keep, other=0.0)
    sums = torch.stack([dot(sel(w), nonzero_A), nonzero_A.sum(), s.sum(), dot(s, s),
                        dot(sel((r - 1).abs()), sel(mu)),     # |π − μ| = μ·|r − 1|, r clamped as in the loss
                        _max(sel(r)), dot(sel(raw), m), m.sum()])
    return dot(sel(value), coef) * scale, sel(total) * scale, None, _stats(sums)


def _max(x):
    return x.amax() if x.numel() else x.new_zeros(())    # [B, 0]: nothing to max


def _stats(sums):
    """The metrics (METRIC_KEYS' order), then ppo_kl's masked mean of −log r and the token
    count, from the sums [Σw, #w, Σs, Σs², Σ|π−μ|, max r, Σ log r, #tokens]. An all-masked
    batch reports 0, not 0/0."""
    w_sum, w_count, toward, total, abs_pi_mu, ratio_max, log_ratio, tokens = sums.unbind()
    n = tokens.clamp(min=1)
    return torch.stack([w_sum / w_count.clamp(min=1), (total + toward) / 2 / n, (total - toward) / 2 / n,
                        abs_pi_mu / n, ratio_max, -log_ratio / n, tokens])


def _eager_kernel(value_and_grad_eager, value_and_grad, mode, logp, anchor, A, action_mask, norm, old=None,
                  rollout=None, weights=None):
    """_kernel's results, eagerly (CPU), where every op costs a few µs of dispatch, and
    comparisons into bool, where() and fresh 1 MB tensors (page faults) are slow: masked slots
    are multiplied by 0 rather than selected, each metric is computed in place in a buffer the
    generated function returned and no longer needs, the metrics are finished in Python (one
    host sync), and the gradient's scale is left to backward. That equals _kernel wherever
    every per-token value is finite; if any result is not (a masked slot held NaN or inf, or
    the objective is not finite somewhere), _kernel recomputes it. test_loss holds the two to
    each other. Tokens are flat, except for an objective with a reduction over each response."""
    exact = functools.partial(_kernel, value_and_grad, mode, logp, anchor, A, action_mask, norm, old, rollout, weights)
    if not logp.numel():      # [B, 0]
        return exact()
    m = _float_mask(action_mask, logp.dtype)
    coef, count = _aggregation_coef(m, mode)
    if weights is not None:
        coef = coef * weights
    tokens = count if mode == "token-mean" else m.sum()
    scale = -1 / (count.clamp(min=1) if norm is None else norm)     # as _kernel, in the same dtype
    if value_and_grad.reduces:       # [B, T]: a reduction reads whole responses
        value, grad, r, raw, mu, inside = value_and_grad(logp, anchor, A, old, rollout, action_mask != 0, coef)
    else:
        flat = lambda x: None if x is None else x.reshape(-1)   # noqa: E731
        A, m, coef = A.reshape(-1), m.reshape(-1), coef.reshape(-1)
        # grad may be an input (GPG's is A): only read
        value, grad, r, raw, mu, inside = value_and_grad_eager(logp.reshape(-1), anchor.reshape(-1), A, flat(old),
                                                               flat(rollout))
    total, spare, scratch = None, value, raw        # value and raw: buffers of their own, free once read
    if getattr(value_and_grad, "includes_coef", False):    # the gradient of Σ coef·ℓ; value and raw may be views
        total, grad = grad, torch.eq(coef, 0, out=torch.empty_like(coef)).add_(coef)   # coef, or 1 where it is 0
        grad = scratch = torch.div(total, grad, out=grad)     # as _per_token; free once w is computed
        spare = torch.empty_like(m)
    loss, log_ratio = _dot(value, coef) * scale, _dot(raw, m)
    masked_r = r.mul_(m)
    ratio_max = masked_r.amax()
    abs_pi_mu = _dot(torch.sub(masked_r, m, out=spare).abs_(), mu)   # |π − μ|·m = μ·|r·m − m|, as m is 0 or 1
    a = torch.mul(A, m, out=mu)       # masked advantages: the metrics below need no other mask
    w = torch.eq(a, 0, out=spare).addcmul_(masked_r, a)      # r·A, or 1 where A = 0 (or masked)
    w = torch.div(grad, w, out=w)                             # w = (∂ℓ/∂log π)/(r·A)
    direction = torch.mul(raw, a, out=scratch).sign_()
    has_w = a.ne_(0)
    w_sum, w_count = _dot(w, has_w), has_w.sum()
    stopped = w.le_(0)              # see _kernel: Σ stopped·direction, Σ stopped·|direction|
    if not isinstance(inside, float):        # some ratio is clamped
        stopped.mul_(inside)
    toward, total_stopped = _dot(stopped, direction), _dot(stopped, direction.abs_())
    # a non-finite ∂ℓ/∂log π anywhere (masked or not) makes w_sum non-finite: w = grad/den
    # and the dot multiplies it by 0 or 1
    values = torch.stack([loss, w_sum, w_count, toward, total_stopped, abs_pi_mu, ratio_max, log_ratio,
                          tokens]).tolist()
    if not all(map(math.isfinite, values)):
        return exact()
    _, w_sum, w_count, toward, total_stopped, abs_pi_mu, ratio_max, log_ratio, tokens = values
    n = max(tokens, 1)
    stats = torch.tensor([w_sum / max(w_count, 1), (total_stopped + toward) / 2 / n, (total_stopped - toward) / 2 / n,
                          abs_pi_mu / n, ratio_max, -log_ratio / n, tokens], dtype=logp.dtype, device=logp.device)
    if total is None:
        total = torch.mul(grad, coef, out=stopped).view_as(logp)
    return loss, total, scale, stats


def check_inputs(who: str, names: dict, tensors: dict) -> None:
    """The tensor boundary: every per-token input is a tensor of log_probs' shape [batch, tokens]
    on its device, floating point (the mask: bool, integer or floating, holding 0 and 1 only),
    or a message naming the tensor, its shape and the fix. `names` maps each argument to the
    host's name for it (ObjectiveLoss calls the mask action_mask). Metadata only, except the
    mask's values: read on the CPU; on CUDA an asynchronous device assert (no host sync)."""
    def fail(msg):
        raise ValueError(f"{who}: {msg}")
    name = lambda key: names.get(key, key)   # noqa: E731
    logp = tensors["log_probs"]
    if not isinstance(logp, torch.Tensor):
        fail(f"{name('log_probs')} must be a torch.Tensor, got {type(logp).__name__}")
    shape = list(logp.shape)
    if logp.dim() != 2:
        fail(f"{name('log_probs')} is {shape}: the loss takes [batch, tokens] (one response: "
             f"{name('log_probs')}.unsqueeze(0))")
    for key, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            fail(f"{name(key)} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
        if list(x.shape) != shape:
            per_response = (x.dim() == 1 and x.shape[0] == shape[0]) or list(x.shape) == [shape[0], 1]
            fix = (f"expand per-response {name(key)} with {name(key)}"
                   f"{'.unsqueeze(-1)' if x.dim() == 1 else ''}.expand_as({name('log_probs')})"
                   if per_response and key in ("advantages", "weights") else
                   f"every per-token input has {name('log_probs')}' shape [batch, tokens]")
            fail(f"{name(key)} is {list(x.shape)}, {name('log_probs')} {shape}: {fix}")
        if x.device != logp.device:
            fail(f"{name(key)} is on {x.device}, {name('log_probs')} on {logp.device}: move it with "
                 f"{name(key)}.to({name('log_probs')}.device)")
        if key != "mask" and not x.is_floating_point():
            fail(f"{name(key)} is {x.dtype}: pass floating-point values ({name(key)}.float())")
    mask = tensors.get("mask")
    if mask is None or mask.dtype == torch.bool:
        return
    if mask.is_complex():
        fail(f"{name('mask')} is {mask.dtype}: pass a bool or 0/1 mask")
    bad = (mask != 0) & (mask != 1)
    msg = (f"{name('mask')} holds values other than 0 and 1{{}}: it selects tokens (1 = a response token, "
           f"0 = padding); pass per-token weights as Aggregation(weights=...), or ({name('mask')} != 0) "
           "to keep every token whose entry is not 0")
    if mask.is_cuda:
        torch._assert_async(~bad.any(), msg.format(""))
    elif bad.any():
        fail(msg.format(f" ({mask[bad][0].item()!r})"))


def _compute_dtype(logp):
    """Half precision is computed in fp32, as peers do: exp and (r-1)^2·|A| overflow fp16."""
    return torch.float32 if logp.dtype in (torch.float16, torch.bfloat16) else logp.dtype


def _fused_function(kernel, who="CompiledLoss"):
    class Fused(torch.autograd.Function):
        """Forward computes the loss and its gradient together and keeps only the gradient:
        backward is one multiply, and no intermediate of the objective stays alive."""

        @staticmethod
        def forward(ctx, logp, anchor, A, mask, norm, old, rollout, weights=None):
            # detached: the kernel is compiled as an inference graph, with no autograd of its own.
            # Every input in the one compute dtype (_compute_dtype): a float64 anchor with
            # float32 log-probs too.
            dtype = _compute_dtype(logp)
            wide = lambda x: x if x is None else x.to(dtype)  # noqa: E731
            loss, grad, scale, stats = kernel(wide(logp.detach()), wide(anchor), wide(A), mask, wide(norm),
                                              wide(old), wide(rollout), wide(weights))
            ctx.save_for_backward(grad)
            ctx.dtype, ctx.scale, ctx.who = logp.dtype, scale, who
            ctx.mark_non_differentiable(stats)
            return loss, stats

        @staticmethod
        def backward(ctx, g, _):
            # The saved gradient is a constant to autograd: a second derivative through it
            # (create_graph=True: a gradient penalty, a Hessian-vector product) would silently
            # lack the objective's own term, even beside other differentiable terms. Grad mode is
            # on here exactly when the caller asked for a graph of the gradient.
            if torch.is_grad_enabled():
                raise RuntimeError(f"{ctx.who}: the fused loss is differentiable once; for create_graph=True "
                                   "(second derivatives) build it with fused=False")
            (grad,) = ctx.saved_tensors
            # g·((grad·coef)·scale), the order _kernel's compiled product gives: equal bit for bit
            grad = g * grad if ctx.scale is None else torch.mul(grad, ctx.scale).mul_(g)
            return grad.to(ctx.dtype), None, None, None, None, None, None, None
    return Fused


class CompiledLoss(nn.Module):
    """An objective compiled to a loss (see the module docstring). `fused=False` runs the plain
    autograd path (the reference for the fused one); `compile` chooses torch.compile for the
    fused kernel ("auto": on CUDA inputs). Keyword overrides name parameters (ASCII or Unicode)
    or the options `anchor` and `aggregate`. `self.metrics` is the last call's LossMetrics."""

    rollout_hint = ""      # how the host keeps rollout log-probs, for the error when it did not
    argument_names: dict = {}      # the host's names for forward's arguments, for its error messages

    def __init__(self, objective: str | Objective = "drpo", *, fused: bool = True, compile: bool | str = "auto",
                 **overrides):
        super().__init__()
        who = type(self).__name__
        if not isinstance(fused, bool):
            raise TypeError(f"{who}: fused must be True or False, got {fused!r}")
        if not (isinstance(compile, bool) or compile == "auto"):
            raise TypeError(f"{who}: compile must be True, False or 'auto', got {compile!r}")
        for name, value in overrides.items():
            # a tensor or array would be read at its own precision (float32 0.2 is 0.200000003)
            if name not in OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float, str, Fraction))):
                raise TypeError(f"{who}: parameter {name}={value!r} must be a Python number or a numeric "
                                f"string, not {type(value).__name__}; pass float(...) of it")
        obj = objective if isinstance(objective, Objective) else dsl.load(objective)
        options = {k: overrides.pop(k) for k in list(overrides) if k in OPTIONS}
        self.objective = obj.with_overrides(overrides, options, where=who) if (overrides or options) else obj
        self._value, self._value_and_grad, self._value_and_grad_eager, self.source = compile_objective(self.objective)
        self.fused = fused
        # "auto": torch.compile (inductor) on CUDA inputs, where compiling takes seconds; eager
        # on CPU, where it takes ~30 s per objective. True/False force it either way.
        self.compile = compile
        self._kernels: dict[tuple, object] = {}
        self.anchor = self.objective.options["anchor"]
        self.names = self.objective.names()
        self.uses_rollout = self.objective.reads_rollout()
        self.aggregate = self.objective.options["aggregate"]
        self.metrics: LossMetrics | None = None     # the last call's
        self.track_extremes = False        # drpo-lab: fill self.extremes on every call
        self.extremes: dict[str, float] = {}

    def extra_repr(self) -> str:
        return f"{self.objective.name}: {self.objective.canonical().splitlines()[-1]}, fused={self.fused}"

    def forward(self, log_probs, old_log_probs, advantages, mask=None, *, rollout_log_probs=None,
                aggregation: Aggregation | None = None) -> LossOutput:
        """(loss, metrics): the loss (its gradient by autograd) and its LossMetrics, aggregated as
        `aggregation` says (the objective's own @aggregate over the local count by default)."""
        agg = aggregation or Aggregation()
        if not isinstance(agg, Aggregation):
            raise TypeError(f"{type(self).__name__}: aggregation must be an Aggregation, got {type(agg).__name__}")
        weights = agg.weights
        check_inputs(type(self).__name__, self.argument_names,
                     {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages, "mask": mask,
                      "rollout_log_probs": rollout_log_probs, "weights": weights})
        if self.uses_rollout and rollout_log_probs is None:
            why = "@anchor = rollout" if self.anchor == "rollout" else "π_rollout"
            raise ValueError(f"objective '{self.objective.name}' uses {why}, but no rollout "
                             f"log-probs were given{self.rollout_hint}")
        mode = agg.mode or self.aggregate
        if mode not in OPTIONS["aggregate"]:
            raise ValueError(f"{type(self).__name__}: aggregation {mode!r} is not one of {list(OPTIONS['aggregate'])}")
        anchor = rollout_log_probs if self.anchor == "rollout" else old_log_probs
        # the policies the objective names besides μ (None where it names none: nothing to compute)
        old = old_log_probs.detach() if "pi_old" in self.names else None
        rollout = rollout_log_probs.detach() if "pi_rollout" in self.names else None
        if mask is None:
            mask = torch.ones_like(log_probs, dtype=torch.bool)
        # the global normalizer, as a tensor so a compiled kernel does not specialize on it
        # (in the kernel's precision: a bf16 count of 1234 would read 1232)
        norm = agg.norm
        if norm is not None:
            norm = torch.as_tensor(norm, dtype=_compute_dtype(log_probs), device=log_probs.device)
        fused = self._fused(log_probs, mode, mask, norm, weights if self.fused else None)
        if self.fused:
            loss, stats = fused.apply(log_probs, anchor, advantages, mask, norm, old, rollout, weights)
        else:
            anchor, advantages = anchor.detach(), advantages.detach()
            keep = mask != 0
            clean = lambda x: x if x is None else torch.where(keep, x, 0.0)   # noqa: E731  select, don't multiply
            per_token = -self._value(clean(log_probs), clean(anchor), clean(advantages), clean(old), clean(rollout),
                                     keep)
            coef, count = _aggregation_coef(keep.to(per_token.dtype), mode)
            if weights is not None:
                coef = coef * clean(weights.detach())
            loss = torch.where(keep, per_token, 0.0).mul(coef).sum() / (count.clamp(min=1) if norm is None else norm)
            loss = torch.where(keep.any(), loss, 0.0)    # all masked: 0, as the fused path defines it
            with torch.no_grad():
                stats = fused.apply(log_probs.detach(), anchor, advantages, mask, norm, old, rollout)[1]
        with torch.no_grad():
            fields = METRICS
            if self._value.filtered is not None:     # in the same tensor: still one host sync
                filtered = self._filtered_fraction(log_probs, anchor, advantages, old, rollout, mask != 0)
                stats, fields = torch.cat([stats, filtered.to(stats.dtype).reshape(1)]), METRICS + (FILTERED,)
            self.metrics = LossMetrics(stats, fields)
            if self.track_extremes:
                self.extremes = self._extremes(log_probs, anchor, advantages, mask != 0, old, rollout, mode)
        return LossOutput(loss, self.metrics)

    def _filtered_fraction(self, logp, anchor, A, old, rollout, keep):
        """The fraction the objective's filters drop (dsl.codegen.filters), at their own
        granularity as OpenRLHF's is_filter_ratio: of unmasked tokens, or, when a filter reads a
        whole response, of non-empty responses (a response counts once all its tokens are dropped)."""
        dtype = _compute_dtype(logp)     # as the loss's
        clean = lambda x: x if x is None else torch.where(keep, x.detach().to(dtype), 0.0)   # noqa: E731
        dropped = self._value.filtered(clean(logp), clean(anchor), clean(A), clean(old), clean(rollout), keep) != 0
        if self._value.filtered_per_response:
            present = keep.any(-1)
            gone = (dropped | ~keep).all(-1) & present
            return gone.sum() / present.sum().clamp(min=1)
        return (dropped & keep).sum() / keep.sum().clamp(min=1)

    def _extremes(self, logp, anchor, A, keep, old, rollout, mode) -> dict:
        """What drpo-lab logs per optimizer step, over unmasked tokens: the range of r and the
        largest per-token |∂ℓ/∂log π|/|A| (over A ≠ 0), with μ at that token. A second,
        plain evaluation of the generated code: only the lab pays for it."""
        if not keep.any():
            return {}
        logp, anchor, A, old, rollout = (x if x is None else x.detach().float() for x in (logp, anchor, A, old, rollout))
        coef = _aggregation_coef(keep.to(logp.dtype), mode)[0]
        _, grad, _, r, _, mu, _ = _per_token(self._value_and_grad, logp, anchor, A, old, rollout, keep, coef)
        weighted = keep & (A != 0)
        weight = torch.where(weighted, grad.abs() / torch.where(weighted, A.abs(), 1.0), -1.0).flatten()
        i = int(weight.argmax())
        out = {"ratio_min": r[keep].min().item(), "ratio_max": r[keep].max().item()}
        if weight[i] >= 0:
            out.update(max_token_weight=weight[i].item(), mu_at_max_token_weight=mu.flatten()[i].item())
        return out

    def _fused(self, logp, mode: str, mask, norm, weights):
        """The autograd Function around the (possibly compiled) kernel, built once per mode and,
        compiled, once per call signature (dtypes, device, which optional inputs are given): each
        has a code object, and so a compile cache, of its own. Dynamo keeps at most
        recompile_limit (8) graphs per code object, and one shared kernel ran every objective
        after the third uncompiled; now only shapes vary within a cache (0/1-sized dimensions are
        specialized: a batch of 1 adds a graph, a new sequence length none)."""
        use = self.compile is True or (self.compile == "auto" and logp.is_cuda)
        key = (mode,) if not use else (mode, _compute_dtype(logp), mask.dtype, logp.device.type, norm is None,
                                        weights is None)
        if (use, key) not in self._kernels:
            if use:
                name = re.sub(r"\W", "_", f"_kernel_{self.objective.name}_{len(self._kernels)}")
                # the function itself is compiled, not a partial of it: dynamo would compile the
                # wrapper that calls a partial, whose code every objective shares
                own = _own_code(_kernel, name)
                bind = lambda f: functools.partial(f, self._value_and_grad, mode, dot=_mul_sum)   # noqa: E731
                kernel = _fallback_warned(bind(torch.compile(own, **COMPILE_OPTIONS)), bind(own), self.objective.name)
            else:
                kernel = functools.partial(_eager_kernel, self._value_and_grad_eager, self._value_and_grad, mode)
            self._kernels[use, key] = _fused_function(kernel, type(self).__name__)
        return self._kernels[use, key]


COMPILE_OPTIONS = {"dynamic": True}     # torch.compile's, for every compiled kernel


def _own_code(fn, name):
    """fn with a code object of its own (named `name`): dynamo keeps its graphs per code object."""
    code = fn.__code__.replace(co_name=name)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _fallback_warned(compiled, eager, objective: str):
    """compiled(...), or eager(...) with one warning naming the objective once dynamo would fall
    back silently (its recompile limit reached: more shapes than a cache holds)."""
    state = {"fn": compiled}

    def run(*args):
        if state["fn"] is compiled:
            # set and restored around the call (config.patch costs ~140 µs a call, this ~9)
            config, before = torch._dynamo.config, torch._dynamo.config.fail_on_recompile_limit_hit
            config.fail_on_recompile_limit_hit = True
            try:
                return compiled(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                warnings.warn(f"objective '{objective}': torch.compile reached its recompile limit "
                              f"({torch._dynamo.config.recompile_limit} graphs for this call signature); its "
                              "fused kernel runs uncompiled from now on", RuntimeWarning, stacklevel=4)
                state["fn"] = eager
            finally:
                config.fail_on_recompile_limit_hit = before
        return state["fn"](*args)
    return run
