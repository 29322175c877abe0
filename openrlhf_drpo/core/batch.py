"""The tensor boundary: a loss call's arguments as one TokenBatch, each checked once (a message
naming the tensor, its shape and the fix), kept only where the objective (or its update rules'
statistics) reads it; and the batch a fused loss over a process group takes."""
from __future__ import annotations

from dataclasses import replace

import torch

from dsl.objective import OPTIONS
from openrlhf_drpo.core.boundary import (binary, check_entropy_graph, check_groups, check_inputs, check_support,
                                         check_turns, group_representatives, refuse_bad_mask, refuse_bad_norm,
                                         refuse_bad_staleness)
from openrlhf_drpo.core.collectives import BatchStatistics
from openrlhf_drpo.core.kernels import aggregation_coef, compute_dtype, denominator
from openrlhf_drpo.core.values import INPUT_NOT_GIVEN, Aggregation, TokenBatch


def token_batch(loss, log_probs, old_log_probs, advantages, mask=None, *, rollout_log_probs=None,
                ref_log_probs=None, entropy=None, sum_pi_sq=None, groups=None, turns=None, staleness=None,
                aggregation: Aggregation | None = None, vocab_log_probs=None, vocab_ref_log_probs=None) -> TokenBatch:
    """CompiledLoss.batch: every input checked, once (each error forward raises: a message naming
    the tensor, its shape and the fix; an input the objective reads and the call lacks), and kept
    only where the objective reads it."""
    who, names = type(loss).__name__, loss.argument_names
    agg = aggregation or Aggregation()
    if not isinstance(agg, Aggregation):
        raise TypeError(f"{who}: aggregation must be an Aggregation, got {type(agg).__name__}")
    check_inputs(who, names, {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages,
                              "mask": mask, "rollout_log_probs": rollout_log_probs, "ref_log_probs": ref_log_probs,
                              "entropy": entropy, "sum_pi_sq": sum_pi_sq, "staleness": staleness,
                              "weights": agg.weights}, mask_values=False)
    check_groups(who, names, groups, log_probs)
    refuse_bad_norm(who, names, agg.norm, mask, log_probs, loss._path(log_probs)[1])
    check_turns(who, names, turns, log_probs)
    refuse_bad_staleness(who, names, staleness if "staleness" in loss.names else None, mask, loss._path(log_probs)[1])
    check_entropy_graph(who, names, entropy if "H" in loss.names else None, log_probs)
    check_support(who, names, {"vocab_log_probs": vocab_log_probs if "pi_v" in loss.names else None,
                               "vocab_ref_log_probs": vocab_ref_log_probs}, log_probs)
    if mask is not None and not loss._path(log_probs)[1]:     # (the sync-free kernels check it in their pass over it)
        refuse_bad_mask(who, names, mask, binary(mask))
    loss.refuse_missing(not_given(loss, {"rollout_log_probs": rollout_log_probs, "ref_log_probs": ref_log_probs,
                                         "entropy": entropy, "sum_pi_sq": sum_pi_sq, "groups": groups,
                                         "turns": turns, "staleness": staleness,
                                         "vocab_log_probs": vocab_log_probs, "vocab_ref_log_probs": vocab_ref_log_probs}))
    if isinstance(agg.process_group, BatchStatistics) and not loss.fused:
        # autograd's gradient through a step total would be this call's ∂f/∂S alone, not the step's λ
        raise ValueError(f"{who}: BatchStatistics (batch reductions over micro-batches) needs the fused path, whose "
                         "reverse mode reads the step's λ = Σ ∂f/∂S from them; the plain path (fused=False) takes "
                         "a batch statistic over one call only: use fused=True")
    mode = agg.mode or loss.aggregate
    if mode not in OPTIONS["aggregate"]:
        raise ValueError(f"{who}: aggregation {mode!r} is not one of {list(OPTIONS['aggregate'])}")
    # the policies and inputs the objective names besides μ (None where it names none: nothing to
    # compute), detached but for H; the process group only where a batch reduction sums over it
    reads = lambda name, x: None if x is None or name not in loss.reads else x.detach()   # noqa: E731
    b = TokenBatch(log_probs, rollout_log_probs if loss.anchor == "rollout" else old_log_probs, advantages,
                   torch.ones_like(log_probs, dtype=torch.bool) if mask is None else mask,
                   old=reads("pi_old", old_log_probs), rollout=reads("pi_rollout", rollout_log_probs),
                   ref=reads("pi_ref", ref_log_probs), entropy=entropy if "H" in loss.reads else None,
                   sum_pi_sq=reads("sum_pi_sq", sum_pi_sq),
                   group=None if groups is None or "groups" not in loss.kept_whole else group_representatives(groups),
                   turns=turns if "turns" in loss._inputs else None, staleness=reads("staleness", staleness),
                   weights=agg.weights, norm=_normalizer(agg.norm, log_probs), mode=mode,
                   pg=agg.process_group if loss.generated.third_version else None,
                   vocab_logp=vocab_log_probs if "pi_v" in loss.names else None,
                   vocab_ref=reads("pi_ref_v", vocab_ref_log_probs))
    return _fold_ranks(b) if loss.fused and b.pg is not None else b


def _fold_ranks(b: TokenBatch) -> TokenBatch:
    """The fused loss of a batch reduction over a process group: its reverse mode all-reduces the
    reduction's adjoint before the kernel's scale −1/N, so each rank's own 1/N goes into its
    tokens' weights first (what autograd's all_reduce does on the plain path), and the kernel's
    normalizer is 1; without a host's weights and with a global normalizer, `rank_fold` says so
    (the same 1/N on every rank, so w needs no second pass, kernels._host_weighted; each rank's
    own 1/N is not uniform once the reduction's adjoint is summed over the ranks)."""
    dtype = compute_dtype(b.logp)
    n = denominator(aggregation_coef((b.mask != 0).to(dtype), b.mode)[1], b.norm)
    ones = torch.ones_like(b.logp, dtype=dtype)
    return replace(b, weights=(1.0 if b.weights is None else b.weights) / n * ones,
                   norm=_normalizer(1.0, b.logp), rank_fold=b.weights is None and b.norm is not None)


def _normalizer(norm, logp):
    """The global normalizer as a 0-d tensor, so that a compiled kernel does not specialize on it,
    in the kernel's precision (a bf16 count of 1234 would read 1232); torch.full, not
    torch.as_tensor: a number copied to the GPU waits for the GPU to drain."""
    dtype = compute_dtype(logp)
    if isinstance(norm, torch.Tensor):
        return norm.to(device=logp.device, dtype=dtype)
    return None if norm is None else torch.full((), float(norm), dtype=dtype, device=logp.device)


def not_given(loss, given: dict) -> dict:
    """refuse_missing's argument for a call: each input not given, with how its host provides it."""
    how = loss.provides or {}
    return {key: INPUT_NOT_GIVEN[key] + (f": {how[key]}" if key in how else "") for key, x in given.items() if x is None}
