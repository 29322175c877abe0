"""The fused kernels: the aggregated loss, its gradient per token and the metric sums in one pass.
Two paths: the sync-free one (`loss_kernel` forward, `grad_kernel` backward, in the autograd
Function `recomputing_function`), which CUDA always takes, compiled by torch.compile or not; and,
uncompiled on the CPU, `eager_kernel` (one host sync a call, a measured CPU speed-up) in
`fused_function`, which saves the gradient. `kernel` is the exact reference both are held to."""
from __future__ import annotations

import functools
import math

import torch

from openrlhf_drpo.core.codegen import CLAMP
from openrlhf_drpo.core.boundary import binary
from openrlhf_drpo.core.collectives import rank_sums, replayed
from openrlhf_drpo.core.values import TENSORS, Generated, TokenBatch

# The metrics' ratio r is OpenRLHF's, exp(clamp(log π − log μ, ±20)), for every objective: an
# objective that never reads r (GSPO: log π − log μ) gets it unclamped from the generated code, where
# one token at log-ratio −110 would make w = (∂ℓ/∂log π)/(r·A) infinite in fp32.
RATIO_RANGE = (math.exp(-CLAMP), math.exp(CLAMP))


def aggregation_coef(m, mode):
    """(coef, count): d loss / d ℓ = −coef/count (ℓ the per-token objective; the loss is minus
    its aggregate), exactly as OpenRLHF's aggregate_loss scales it (m is the float mask), where
    a given normalizer (batch_num_tokens or global_batch_size, over dp_size) replaces count.
    Token mode divides by the token count; sample mode averages the per-sequence means (over
    length + 1e-8, as OpenRLHF and verl) over non-empty sequences. The token-sum modes are verl's
    agg_loss: each sequence's token sum (over T, the padded length, for -norm), averaged over
    non-empty sequences."""
    if mode == "token-mean":
        return m, m.sum()
    count = m.sum(dim=-1, keepdim=True)
    per_seq = {"seq-mean-token-mean": 1 / (count + 1e-8), "seq-mean-token-sum": 1.0,
               "seq-mean-token-sum-norm": 1 / max(m.shape[-1], 1)}[mode]
    seq = (count > 0).to(m.dtype)
    return m * (per_seq * seq), seq.sum()


def denominator(count, norm):
    """What the aggregate is divided by: the local count (at least 1: all masked, 0/1), or the global
    normalizer, 0 only where the step has no token (Aggregation.norm): then 1, so that every path gives
    the loss 0 and the gradient 0 (0/0 would be NaN), without reading the value on the host."""
    return count.clamp(min=1) if norm is None else torch.where(norm == 0, 1.0, norm)


def _float_mask(action_mask, dtype):
    # on CPU a bool tensor converts ~4x slower than uint8, and a comparison into bool ~4x
    # slower than into float
    if action_mask.dtype == torch.bool:
        return action_mask.view(torch.uint8).to(dtype)
    return torch.ne(action_mask, 0, out=torch.empty_like(action_mask, dtype=dtype))


def _dot(x, y):
    return torch.dot(x.reshape(-1), y.reshape(-1))


def mul_sum(x, y):
    return (x * y).sum()      # what inductor fuses into the loop (a dot is a separate BLAS call)


def per_token(generated: Generated, b: TokenBatch, keep, coef):
    """The generated function's results, with its gradient per token as ∂ℓ/∂log π, and the
    gradient of Σ coef·ℓ (for an objective with a reduction, which computes that one itself,
    ∂ℓ/∂log π is that over coef: the gradient a token gets per unit of its weight); last, the
    gradient of Σ coef·ℓ with respect to each input with a channel of its own (Generated.channels:
    H, the support's log π_v), as {field: gradient}."""
    value, grad, r, raw, mu, inside, *extra = generated.value_and_grad(b, keep, coef)
    entropy = dict(zip(generated.channels, extra))     # (only the reverse-mode function returns them: coef inside)
    if generated.includes_coef:
        return value, grad / torch.where(coef != 0, coef, 1.0), grad, r, raw, mu, inside, entropy
    return value, grad, grad * coef, r, raw, mu, inside, entropy


def _terms(generated: Generated, b: TokenBatch, clamp_ratio, metrics=True):
    """The mask, the aggregation's coef and count, and the generated function's per-token results
    (per_token), with the metrics' ratio in RATIO_RANGE where the generated one is unclamped."""
    keep = b.mask != 0       # (.bool() here costs torch.compile on CPU a 1.6x slower kernel)
    m = keep.to(b.logp.dtype)
    coef, count = aggregation_coef(m, b.mode)
    own = coef
    if b.weights is not None:
        # a host's per-token weights (verl's rollout IS weights): in the sum, not the count, and
        # selected by the mask as every input (a NaN in a masked slot stays out)
        coef = coef * torch.where(keep, b.weights, 0.0)
    value, grad, total, r, raw, mu, inside, entropy = per_token(generated, b, keep, coef)
    if metrics and _host_weighted(generated, b):
        grad = _own_gradient(generated, b, keep, own)
    if clamp_ratio:
        r = r.clamp(*RATIO_RANGE)
    return keep, m, coef, count, value, grad, total, r, raw, mu, inside, entropy


def _host_weighted(generated: Generated, b: TokenBatch) -> bool:
    """Whether w needs _own_gradient: a host's weights under an objective whose gradient goes
    through a reduction (not the loss core's own per-rank 1/N fold, `rank_fold`, which is uniform
    on a rank). Decided by the configuration alone: its collectives never depend on the values."""
    return b.weights is not None and generated.includes_coef and not b.rank_fold


def _own_gradient(generated: Generated, b: TokenBatch, keep, coef):
    """∂ℓ/∂log π per unit of the aggregation's own weight coef, without the host's weights: w is
    the objective's, on every path (a reduction spreads a token's gradient by the weights of the
    tokens that read it, so with uneven host weights (0/1 masks) the weighted gradient per unit of
    a token's weight is not the objective's): one more evaluation, only for such an objective."""
    return per_token(generated, b, keep, coef)[1]


def _loss_and_stats(terms, A, norm, dot, log_ratio=None):
    """(loss, scale, stats): the aggregated loss -Σ c·ℓ·scale, the gradient's scale (-1/count or
    -1/norm) and the metrics (_stats). Every per-token quantity is selected by the mask before it
    is reduced, so masked slots never leak."""
    keep, m, coef, count, value, grad, total, r, raw, mu, inside, _ = terms
    scale = -1 / denominator(count, norm)     # all masked: 0/1, no gradient (OpenRLHF: 0/0)
    nonzero_A = torch.sign(A).abs()
    w = grad / (r * A + (1 - nonzero_A))      # w = (∂ℓ/∂log π)/(r·A), where A ≠ 0
    # w ≤ 0: the trust-region boundary is reached, unless the ratio clamp zeroed the gradient
    # (`inside` = 0: a numerical stop, not the objective's). The move's direction is the sign
    # of A·(log π − log μ) (0 where A = 0): +1 diverging, −1 converging. So with
    # s = stopped·direction on unmasked tokens, Σs = diverging − converging and Σs² = their sum.
    s = torch.where(keep, (1 - torch.relu(torch.sign(w))) * inside * torch.sign(raw * A), 0.0)
    nonzero_A = torch.where(keep, nonzero_A, 0.0)
    sel = functools.partial(torch.where, keep, other=0.0)
    # w_mean's tokens: A ≠ 0 and, for an objective on the raw ratio (log_ratio given), that ratio
    # within the loss's clamp: beyond it w = ∂ℓ/∂log π over an e^±800 that no double holds (the
    # others' w is 0 there, as the clamp applies it). The token's own log-ratio: a sequence
    # objective's raw is its response's mean.
    within = keep if log_ratio is None else (log_ratio.abs() <= CLAMP) & keep
    has_w = torch.where(within, nonzero_A, 0.0)
    sums = torch.stack([dot(torch.where(within, w, 0.0), has_w), has_w.sum(), s.sum(), dot(s, s),
                        dot(sel((r - 1).abs()), sel(mu)),     # |π − μ| = μ·|r − 1|, r clamped as in the loss
                        _max(sel(r)), dot(sel(raw), m), m.sum()])
    return dot(sel(value), coef) * scale, scale, _stats(sums)


def kernel(generated: Generated, b: TokenBatch, dot=_dot, clamp_ratio=False):
    """The aggregated loss -Σ c·ℓ, its gradient -c·∂ℓ/∂log π, the gradient with respect to H
    (None where the objective does not read it), the scale (None: already applied) and the
    metric sums, in one function. With dot=_dot, loss and gradient equal eager_kernel's bit for
    bit, and loss_kernel's and grad_kernel's (uncompiled) too."""
    b, _ = rank_sums(b)
    terms = _terms(generated, b, clamp_ratio)
    loss, scale, stats = _loss_and_stats(terms, b.A, b.norm, dot, b.logp - b.anchor if clamp_ratio else None)
    return loss, *_gradients(terms, scale), None, stats


def _gradients(terms, scale):
    """The loss's gradients with respect to log π and each channel's input ({field: gradient}), masked tokens 0."""
    keep, total, entropy = terms[0], terms[6], terms[11]
    return torch.where(keep, total, 0.0) * scale, {k: _kept(keep, e) * scale for k, e in entropy.items()}


def _kept(keep, x):
    """x where its token is unmasked, else 0: a [B, T, k] channel (the support's) entry by entry."""
    return torch.where(keep if x.dim() == keep.dim() else keep.unsqueeze(-1), x, 0.0)


def loss_kernel(generated: Generated, b: TokenBatch, dot=_dot, clamp_ratio=False):
    """The sync-free forward: (loss, scale, stats) as kernel's, whether the mask holds 0 and 1
    only (binary) and the batch reductions' totals over the ranks (for backward to replay), from
    inputs in their own dtypes, keeping no per-token tensor (torch.compile turns it into
    reductions that read each input once)."""
    b, sums = rank_sums(b.widened(compute_dtype(b.logp)))
    terms = _terms(generated, b, clamp_ratio)
    return (*_loss_and_stats(terms, b.A, b.norm, dot, b.logp - b.anchor if clamp_ratio else None), binary(b.mask),
            replayed(sums))


def grad_kernel(generated: Generated, b: TokenBatch, scale, g, totals=None):
    """The sync-free backward: g·(kernel's gradients), recomputed from the inputs in one pass and
    written once, in log π's dtype (the product in kernel's and backward's order: equal bit for
    bit); with respect to log π, and to H (None where the objective does not read it). `totals`:
    loss_kernel's sums over the ranks, replayed (no collective a second time)."""
    dtype = b.logp.dtype
    b, _ = rank_sums(b.widened(compute_dtype(b.logp)), totals)
    terms = _terms(generated, b, False, metrics=False)
    grad, entropy = _gradients(terms, scale)
    return (grad * g).to(dtype), {k: (e * g).to(dtype) for k, e in entropy.items()}


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


def eager_kernel(generated: Generated, b: TokenBatch, clamp_ratio=False):
    """kernel's results, eagerly (CPU), where every op costs a few µs of dispatch, and
    comparisons into bool, where() and fresh 1 MB tensors (page faults) are slow: masked slots
    are multiplied by 0 rather than selected, each metric is computed in place in a buffer the
    generated function returned and no longer needs, the metrics are finished in Python (one
    host sync), and the gradient's scale is left to backward. That equals kernel wherever
    every per-token value is finite; if any result is not (a masked slot held NaN or inf, or
    the objective is not finite somewhere), kernel recomputes it. test_loss holds the two to
    each other, and kernel replays the batch reductions' sums over the ranks (core.collectives):
    every rank issues the same collectives whatever its values. Tokens are flat, except for an
    objective with a reduction over each response."""
    b, sums = rank_sums(b)
    logp, anchor, A, action_mask, norm = b.logp, b.anchor, b.A, b.mask, b.norm
    if not logp.numel():      # [B, 0]
        return kernel(generated, b, clamp_ratio=clamp_ratio)
    m = _float_mask(action_mask, logp.dtype)
    coef, count = aggregation_coef(m, b.mode)
    own = coef
    if b.weights is not None:     # selected by the mask, as kernel's
        coef = coef * torch.where(action_mask != 0, b.weights, 0.0)
    tokens = count if b.mode == "token-mean" else m.sum()
    scale = -1 / denominator(count, norm)     # as kernel, in the same dtype
    entropy = {}
    if generated.reduces:       # [B, T]: a reduction reads whole responses
        value, grad, r, raw, mu, inside, *extra = generated.value_and_grad(b, action_mask != 0, coef)
        # d(Σ coef·ℓ)/dH (and the support's), masked tokens selected out (H may hold anything there)
        entropy = {k: _kept(action_mask != 0, e) for k, e in zip(generated.channels, extra)}
    else:
        A, m, coef = A.reshape(-1), m.reshape(-1), coef.reshape(-1)
        # grad may be an input (GPG's is A): only read
        value, grad, r, raw, mu, inside = generated.value_and_grad_eager(b.flat())
    total, spare, scratch = None, value, raw        # value and raw: buffers of their own, free once read
    if generated.includes_coef:    # the gradient of Σ coef·ℓ; value and raw may be views
        total, grad = grad, torch.eq(coef, 0, out=torch.empty_like(coef)).add_(coef)   # coef, or 1 where it is 0
        grad = scratch = torch.div(total, grad, out=grad)     # as _per_token; free once w is computed
        if _host_weighted(generated, b):     # w leaves the host's weights out, as kernel's
            grad = scratch = _own_gradient(generated, b, action_mask != 0, own)
        spare = torch.empty_like(m)
    loss, log_ratio = _dot(value, coef) * scale, _dot(raw, m)
    if clamp_ratio:
        r.clamp_(*RATIO_RANGE)
    masked_r = r.mul_(m)
    ratio_max = masked_r.amax()
    abs_pi_mu = _dot(torch.sub(masked_r, m, out=spare).abs_(), mu)   # |π − μ|·m = μ·|r·m − m|, as m is 0 or 1
    a = torch.mul(A, m, out=mu)       # masked advantages: the metrics below need no other mask
    w = torch.eq(a, 0, out=spare).addcmul_(masked_r, a)      # r·A, or 1 where A = 0 (or masked)
    w = torch.div(grad, w, out=w)                             # w = (∂ℓ/∂log π)/(r·A)
    # w_mean's tokens: A ≠ 0 and, for an objective on the raw ratio, that ratio within the clamp
    # (kernel says why; the token's own log-ratio, as there)
    outside = torch.gt((logp - anchor).abs().reshape(raw.shape), CLAMP) if clamp_ratio else None
    direction = torch.mul(raw, a, out=scratch).sign_()
    has_w = a.ne_(0)
    # probe: non-finite wherever some ∂ℓ/∂log π is, masked or not (w = grad/den, times 0 or 1),
    # so that the check below falls back to kernel, which selects
    w_sum = probe = _dot(w, has_w)
    if outside is not None and outside.any():
        has_w.masked_fill_(outside, 0.0)
        w_sum = _dot(torch.where(outside, 0.0, w), has_w)
    w_count = has_w.sum()
    stopped = w.le_(0)              # see kernel: Σ stopped·direction, Σ stopped·|direction|
    if not isinstance(inside, float):        # some ratio is clamped
        stopped.mul_(inside)
    toward, total_stopped = _dot(stopped, direction), _dot(stopped, direction.abs_())
    values = torch.stack([loss, w_sum, w_count, toward, total_stopped, abs_pi_mu, ratio_max, log_ratio,
                          tokens, probe]).tolist()
    if not all(map(math.isfinite, values)):
        return kernel(generated, rank_sums(b, replayed(sums))[0], clamp_ratio=clamp_ratio)
    _, w_sum, w_count, toward, total_stopped, abs_pi_mu, ratio_max, log_ratio, tokens, _ = values
    n = max(tokens, 1)
    stats = torch.tensor([w_sum / max(w_count, 1), (total_stopped + toward) / 2 / n, (total_stopped - toward) / 2 / n,
                          abs_pi_mu / n, ratio_max, -log_ratio / n, tokens], dtype=logp.dtype, device=logp.device)
    if total is None:
        total = torch.mul(grad, coef, out=stopped).view_as(logp)
    return loss, total, entropy, scale, stats


def compute_dtype(logp):
    """Half precision is computed in fp32, as peers do: exp and (r-1)^2·|A| overflow fp16."""
    return torch.float32 if logp.dtype in (torch.float16, torch.bfloat16) else logp.dtype


def fused_function(kernel, who="CompiledLoss"):
    """The fused loss around kernel or eager_kernel (bound to an objective): the CPU's uncompiled
    path, where a second pass over the objective costs more than keeping its gradient. The
    entropy H, where the objective reads it, is an input with a gradient of its own. Called as
    apply(b, *b.tensors()) (CompiledLoss._loss says why)."""
    class Fused(torch.autograd.Function):
        """Forward computes the loss and its gradient together and keeps only the gradient:
        backward is one multiply, and no intermediate of the objective stays alive."""

        @staticmethod
        def forward(ctx, b, *tensors):
            # detached: the kernel is compiled as an inference graph, with no autograd of its own.
            # Every input in the one compute dtype (compute_dtype): a float64 anchor with
            # float32 log-probs too.
            ctx.dtype = b.logp.dtype
            loss, grad, grad_entropy, scale, stats = kernel(b.detached().widened(compute_dtype(b.logp)))
            ctx.channels = {k: getattr(b, k).dtype for k in grad_entropy}     # each in its input's dtype
            ctx.save_for_backward(grad, *grad_entropy.values())
            ctx.scale = scale
            ctx.mark_non_differentiable(stats)
            return loss, stats

        @staticmethod
        def backward(ctx, g, _):
            _once(who)
            grad, *extra = ctx.saved_tensors
            # g·((grad·coef)·scale), the order kernel's compiled product gives: equal bit for bit
            scaled = lambda x: g * x if ctx.scale is None else torch.mul(x, ctx.scale).mul_(g)   # noqa: E731
            channels = {k: scaled(e).to(dtype) for (k, dtype), e in zip(ctx.channels.items(), extra)}
            return None, *_by_field(scaled(grad).to(ctx.dtype), channels)
    return Fused


def _by_field(logp, channels: dict):
    """The gradients backward returns for apply(b, *b.tensors()): log π's and each channel's (H's, the
    support's), None for the rest."""
    return tuple(logp if name == "logp" else channels.get(name) for name in TENSORS)


def _once(who):
    # The gradient is a constant to autograd: a second derivative through it (create_graph=True:
    # a gradient penalty, a Hessian-vector product) would silently lack the objective's own term,
    # even beside other differentiable terms. Grad mode is on in backward exactly when the caller
    # asked for a graph of the gradient.
    if torch.is_grad_enabled():
        raise RuntimeError(f"{who}: the fused loss is differentiable once; for create_graph=True "
                           "(second derivatives) build it with fused=False")


def recomputing_function(forward, backward, refuse_mask, who="CompiledLoss"):
    """The sync-free fused loss around loss_kernel and grad_kernel (bound to an objective; compiled
    or not; refuse_mask(mask, ok) is boundary.refuse_bad_mask bound to the host's names). It keeps
    no per-token tensor between forward and backward: it saves its inputs, which are alive anyway,
    and backward recomputes the gradient, as torch.compile's own partitioner does for a
    hand-written loss. So the peak is the gradient alone, in log π's dtype, and each pass reads the
    inputs once (a saved fp32 gradient would hold 2-3x that). Called as apply(b, *b.tensors())."""
    class Recomputing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, b, *tensors):
            b = b.detached()
            loss, scale, stats, ok, totals = forward(b)
            refuse_mask(b.mask, ok)
            # the batch's tensors saved (no gradient, alive anyway), its other fields kept, and
            # forward's sums over the ranks, which backward replays: the same collectives as forward's alone
            ctx.save_for_backward(scale, *b.tensors())
            ctx.batch, ctx.totals = b, totals
            ctx.mark_non_differentiable(stats)
            ctx.set_materialize_grads(False)     # (no zeros for the metrics' gradient, which is never read)
            return loss, stats

        @staticmethod
        def backward(ctx, g, _):
            _once(who)
            scale, *tensors = ctx.saved_tensors
            b = ctx.batch.with_tensors(tensors)
            grad, extra = backward(b, scale, g, totals=ctx.totals)
            return None, *_by_field(grad, {k: e.to(getattr(b, k).dtype) for k, e in extra.items()})
    return Recomputing
