"""What the loss core measures beside the loss: the fraction an objective's filters drop
(OpenRLHF's is_filter_ratio) and drpo-lab's per-step extremes."""
from __future__ import annotations

import torch

from openrlhf_drpo.core.collectives import rank_sums
from openrlhf_drpo.core.kernels import aggregation_coef, compute_dtype, per_token
from openrlhf_drpo.core.values import Generated, TokenBatch


def filtered_fraction(generated: Generated, b: TokenBatch):
    """The fraction the objective's filters drop (openrlhf_drpo.core.codegen.filters), at their own
    granularity as OpenRLHF's is_filter_ratio: of unmasked tokens, or, when a filter reads a
    whole response, of non-empty responses (a response counts once all its tokens are dropped)."""
    keep, dtype = b.mask != 0, compute_dtype(b.logp)     # as the loss's
    b, _ = rank_sums(b.selected(lambda x: torch.where(keep, x.detach().to(dtype), 0.0)))
    dropped = generated.filtered(b, keep) != 0
    if generated.filtered_per_response:
        present = keep.any(-1)
        gone = (dropped | ~keep).all(-1) & present
        return gone.sum() / present.sum().clamp(min=1)
    return (dropped & keep).sum() / keep.sum().clamp(min=1)


def lab_extremes(generated: Generated, b: TokenBatch) -> dict:
    """What drpo-lab logs per optimizer step, over unmasked tokens: the range of r, the largest
    per-token |∂ℓ/∂log π|/|A| (over A ≠ 0), with μ at that token, and as sums: the tokens, those
    past the objective's boundary, Σr and Σr² (the ratios' ESS, (Σr)²/(n·Σr²)). A second,
    plain evaluation of the generated code: only the lab pays for it, and on every rank, token or
    none (its batch reductions' sums over the ranks are collectives every rank issues)."""
    keep, b = b.mask != 0, b.selected(lambda x: x.detach().float())
    coef = aggregation_coef(keep.to(b.logp.dtype), b.mode)[0]
    _, grad, _, r, _, mu, inside, _ = per_token(generated, rank_sums(b)[0], keep, coef)
    if not keep.any():
        return {}
    A = b.A
    weighted = keep & (A != 0)
    weight = torch.where(weighted, grad.abs() / torch.where(weighted, A.abs(), 1.0), -1.0).flatten()
    i = int(weight.argmax())
    # past the boundary (clipped, masked or filtered): w = ∂ℓ/∂log π / (r·A) ≤ 0 where A ≠ 0, as the
    # kernels' drpo_past_boundary_* count it, bar a stop the ratio's numerical clamp made (inside = 0).
    # Sums, not fractions, so that an optimizer step's micro-batches add up (hosts' _merge).
    past = weighted & (grad * A <= 0) & (torch.as_tensor(inside, device=grad.device) != 0)
    kept_r = r[keep].double()
    out = {"ratio_min": r[keep].min().item(), "ratio_max": r[keep].max().item(), "tokens": int(keep.sum()),
           "past_boundary": int(past.sum()), "ratio_sum": kept_r.sum().item(), "ratio_sq_sum": kept_r.square().sum().item()}
    if weight[i] >= 0:
        out.update(max_token_weight=weight[i].item(), mu_at_max_token_weight=mu.flatten()[i].item())
    return out
