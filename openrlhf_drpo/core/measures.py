"""What the loss core measures beside the loss: the fraction an objective's filters drop
(OpenRLHF's is_filter_ratio) and drpo-lab's per-step extremes."""
from __future__ import annotations

import torch

from openrlhf_drpo.core.collectives import rank_sums
from openrlhf_drpo.core.kernels import aggregation_coef, compute_dtype, per_token


def filtered_fraction(value, logp, anchor, A, old, rollout, keep, ext=None):
    """The fraction the objective's filters drop (openrlhf_drpo.core.codegen.filters), at their own
    granularity as OpenRLHF's is_filter_ratio: of unmasked tokens, or, when a filter reads a
    whole response, of non-empty responses (a response counts once all its tokens are dropped)."""
    dtype = compute_dtype(logp)     # as the loss's
    clean = lambda x: x if x is None else torch.where(keep, x.detach().to(dtype), 0.0)   # noqa: E731
    ext = None if ext is None else {k: clean(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                                    for k, v in ext.items()}
    ext, _ = rank_sums(ext)
    dropped = value.filtered(clean(logp), clean(anchor), clean(A), clean(old), clean(rollout), keep, ext) != 0
    if value.filtered_per_response:
        present = keep.any(-1)
        gone = (dropped | ~keep).all(-1) & present
        return gone.sum() / present.sum().clamp(min=1)
    return (dropped & keep).sum() / keep.sum().clamp(min=1)


def lab_extremes(value_and_grad, logp, anchor, A, keep, old, rollout, mode, ext=None) -> dict:
    """What drpo-lab logs per optimizer step, over unmasked tokens: the range of r and the
    largest per-token |∂ℓ/∂log π|/|A| (over A ≠ 0), with μ at that token. A second,
    plain evaluation of the generated code: only the lab pays for it, and on every rank, token or
    none (its batch reductions' sums over the ranks are collectives every rank issues)."""
    logp, anchor, A, old, rollout = (x if x is None else x.detach().float() for x in (logp, anchor, A, old, rollout))
    coef = aggregation_coef(keep.to(logp.dtype), mode)[0]
    ext = None if ext is None else {k: v.detach().float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                    else v for k, v in ext.items()}
    _, grad, _, r, _, mu, _, _ = per_token(value_and_grad, logp, anchor, A, old, rollout, keep, coef, rank_sums(ext)[0])
    if not keep.any():
        return {}
    weighted = keep & (A != 0)
    weight = torch.where(weighted, grad.abs() / torch.where(weighted, A.abs(), 1.0), -1.0).flatten()
    i = int(weight.argmax())
    out = {"ratio_min": r[keep].min().item(), "ratio_max": r[keep].max().item()}
    if weight[i] >= 0:
        out.update(max_token_weight=weight[i].item(), mu_at_max_token_weight=mu.flatten()[i].item())
    return out
