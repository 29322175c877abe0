"""The torch functions the reduction rows' torch text calls (`_seq_sum(x, m, logp)`, ...: dsl.operations),
over the tokens m selects (selected, never multiplied: a masked NaN stays out). An empty response, group
or batch reduces to 0. Each reduction row has its function here, of its own name (ROWS, checked when
this module is imported, as core.codegen's KERNELS); the generated code imports the ones it calls under
the names its text uses (NAMESPACE), and the plain path differentiates them by autograd."""
from __future__ import annotations

import math

import torch

from dsl.operations import OPS
from openrlhf_drpo.core.collectives import RankSums

def _selected(x, m, other, like):
    # a folded constant (prefix_sum(1)) is filled on the device: as_tensor of a number is a host copy
    x = torch.full_like(like, x) if isinstance(x, (int, float)) else torch.as_tensor(x, dtype=like.dtype,
                                                                                    device=like.device)
    return torch.where(m, x, other)


def seq_sum(x, m, like):
    return _selected(x, m, 0.0, like).sum(-1, keepdim=True).expand_as(like)


def seq_mean(x, m, like):
    n = m.sum(-1, keepdim=True).clamp(min=1)
    return (_selected(x, m, 0.0, like).sum(-1, keepdim=True) / n).expand_as(like)


def _seq_extreme(x, m, like, pick, empty):
    if like.shape[-1] == 0:             # no token: 0, still attached to x's graph
        return seq_sum(x, m, like)
    top = pick(_selected(x, m, empty, like), -1, keepdim=True)
    return torch.where(m.any(-1, keepdim=True), top, 0.0).expand_as(like)


def seq_max(x, m, like):
    return _seq_extreme(x, m, like, torch.amax, -math.inf)


def seq_min(x, m, like):
    return _seq_extreme(x, m, like, torch.amin, math.inf)


def prefix_sum(x, m, like):            # inclusive: this token's own value counts
    return _selected(x, m, 0.0, like).cumsum(-1)


def prefix_mean(x, m, like):
    return prefix_sum(x, m, like) / prefix_sum(1.0, m, like).clamp(min=1)


def suffix_sum(x, m, like):            # the reverse mode's adjoint of a prefix sum
    return _selected(x, m, 0.0, like).flip(-1).cumsum(-1).flip(-1)


def turn_sum(x, m, like, turns):
    """Σ x over the unmasked tokens of each token's turn (the tokens of its row with its turn id),
    without a host sync: each row's ids sorted (stable), each run of equal ids one segment, its
    sum gathered by index_add and scattered back to the tokens' own positions."""
    ids, order = torch.sort(turns, dim=-1, stable=True)
    B, T = ids.shape
    fresh = torch.ones_like(ids, dtype=torch.bool)
    fresh[:, 1:] = ids[:, 1:] != ids[:, :-1]
    slot = (fresh.long().cumsum(-1) - 1) + torch.arange(B, device=ids.device)[:, None] * T
    values = _selected(x, m, 0.0, like).expand_as(like).gather(-1, order)
    sums = torch.zeros(B * T, dtype=values.dtype, device=values.device).index_add(0, slot.reshape(-1),
                                                                                 values.reshape(-1))
    return torch.empty_like(values).scatter(-1, order, sums[slot])


def turn_len(m, like, turns):
    return turn_sum(1.0, m, like, turns)


def turn_mean(x, m, like, turns):
    return turn_sum(x, m, like, turns) / turn_len(m, like, turns).clamp(min=1)


def _seq_order(x, m, like, q):
    """_batch_order's, along each response ([B, 1] each): its lower and upper neighbours among its unmasked
    tokens, the weight f, the count n and whether one is NaN; sorted per row without gradient, no host sync."""
    values, n = _selected(x, m, 0.0, like).expand_as(like), m.sum(-1, keepdim=True)
    nan = (m & values.isnan()).any(-1, keepdim=True)
    if like.shape[-1] == 0:             # no token: 0, still attached to x's graph
        zero = values.sum(-1, keepdim=True)
        return zero, zero, zero, n, nan
    rank = q * (n - 1).clamp(min=0).to(like.dtype)
    below = rank.floor()
    order = torch.where(m, values, math.inf).detach().sort(-1).values

    def neighbour(k):
        at = order.gather(-1, k.long())
        return torch.where(m & (values <= at), values, -math.inf).amax(-1, keepdim=True)
    return neighbour(below), neighbour(rank.ceil()), rank - below, n, nan


def seq_quantile(x, m, like, q):
    low, high, frac, n, nan = _seq_order(x, m, like, q)
    return _batch_stat(torch.where(low == high, low, torch.lerp(low, high, frac)), n, nan, like)


def seq_qlow(x, m, like, q):          # seq_quantile's neighbours and weight (its adjoint's)
    low, _, _, n, nan = _seq_order(x, m, like, q)
    return _batch_stat(low, n, nan, like)


def seq_qhigh(x, m, like, q):
    _, high, _, n, nan = _seq_order(x, m, like, q)
    return _batch_stat(high, n, nan, like)


def seq_qfrac(x, m, like, q):
    frac, n = _seq_order(x, m, like, q)[2:4]
    return torch.where(n > 0, frac, 0.0).expand_as(like)


def _response_values(x, m, like):
    """[B, 1]: each response's value of a response-level x, read at its first unmasked token (all its
    tokens hold it): carried, never rebuilt from its copies (Σ/n may differ from them in the last bit,
    and then an adjoint's tie test, which reads x, misses); 0 for an empty response; and 1 where the
    response is not empty."""
    values, present = _selected(x, m, 0.0, like), m.any(-1, keepdim=True).to(like.dtype)
    if like.shape[-1] == 0:             # no token: 0, still attached to x's graph
        return values.sum(-1, keepdim=True), present
    first = m.to(torch.uint8).argmax(-1, keepdim=True)     # (an empty response's slot 0 is selected: 0)
    return values.expand_as(like).gather(-1, first), present


def _group_totals(x, m, like, group, level):
    """Σ x and the element count over each response's group, broadcast to its tokens: per
    position over the group's responses unmasked there ('token'), or per non-empty response
    ('response'). group[b] is the first response of b's group: a sum at that row, read back."""
    if level == "token":
        values, counts = _selected(x, m, 0.0, like), m.to(like.dtype)
    else:
        values, counts = _response_values(x, m, like)
    sums = torch.zeros_like(values).index_add(0, group, values)[group]
    n = torch.zeros_like(counts).index_add(0, group, counts)[group]
    return sums.expand_as(like), n.expand_as(like)


def group_sum(x, m, like, group, level):
    return _group_totals(x, m, like, group, level)[0]


def group_count(x, m, like, group, level):
    return _group_totals(x, m, like, group, level)[1]


def group_mean(x, m, like, group, level):
    total, n = _group_totals(x, m, like, group, level)
    return total / n.clamp(min=1)


def group_std(x, m, like, group, level):
    """The sample standard deviation (ddof = 1) in two passes, of x less its group's largest element
    (a constant shift, without gradient: the deviations are unchanged in exact arithmetic), so that
    equal elements deviate by exactly 0, not by the mean's rounding; 0 below two elements, and where
    all are equal, with a zero gradient there (autograd's through sqrt(0) would be inf·0)."""
    x = _selected(x, m, 0.0, like)
    x = x - _group_extreme(x.detach(), m, like, group, level, torch.amax, -math.inf)
    total, n = _group_totals(x, m, like, group, level)
    dev = _selected(x - total / n.clamp(min=1), m, 0.0, like)
    var = group_sum(dev * dev, m, like, group, level) / (n - 1).clamp(min=1)
    # not `var > 0`: a group with an infinite element has a NaN variance, which must stay NaN, never 0
    spread = (n >= 2) & ~(var <= 0)
    return torch.where(spread, torch.sqrt(torch.where(spread, var, 1.0)), 0.0)


def _group_extreme(x, m, like, group, level, pick, empty):
    """The largest (smallest) over each response's group: per position over its responses unmasked
    there ('token'), or over its non-empty responses ('response'); 0 over none. Ties share the
    gradient (torch.amax's)."""
    if level == "token":
        values = _selected(x, m, empty, like)
    else:
        values, present = _response_values(x, m, like)
        values = torch.where(present > 0, values, empty)
    mates = group[:, None] == group[None, :]
    top = pick(torch.where(mates[:, :, None], values[None], empty), 1)
    n = _group_totals(x, m, like, group, level)[1]
    return torch.where(n > 0, top, 0.0).expand_as(like)


def group_max(x, m, like, group, level):
    return _group_extreme(x, m, like, group, level, torch.amax, -math.inf)


def group_min(x, m, like, group, level):
    return _group_extreme(x, m, like, group, level, torch.amin, math.inf)


def _all_ranks(t, pg):
    """t summed over the data-parallel ranks by pg (the loss core's function, which issues or
    replays the all-reduce: core.collectives), or t alone where pg is None."""
    return t if pg is None else pg(t)


def _batch_totals(x, m, like, pg, level):
    """Σ x and the element count over the batch (its unmasked tokens, or its non-empty responses),
    summed over the ranks in one all-reduce."""
    if level == "token":
        values, counts = _selected(x, m, 0.0, like), m.to(like.dtype)
    else:
        values, counts = _response_values(x, m, like)
    return _all_ranks(torch.stack([values.sum(), counts.sum()]), pg).unbind()


def batch_sum(x, m, like, pg, level):
    return _batch_totals(x, m, like, pg, level)[0].expand_as(like)


def batch_count(x, m, like, pg, level):
    return _batch_totals(x, m, like, pg, level)[1].expand_as(like)


def batch_mean(x, m, like, pg, level):
    total, n = _batch_totals(x, m, like, pg, level)
    return (total / n.clamp(min=1)).expand_as(like)


def _batch_order(x, m, like, pg, level, q):
    """What torch.quantile(elements, q) interpolates, over the batch's elements (its unmasked tokens, or
    its non-empty responses): (its lower and upper neighbours, the weight f, the count n, whether an
    element is NaN). Each neighbour is the largest element at most that order statistic (sorted
    without gradient, no host sync), so that its ties share its gradient, as torch.amax's. One rank
    only: an order statistic across ranks needs their values, not a sum of them."""
    group = pg.group if isinstance(pg, RankSums) else pg     # (the loss core wraps its process group)
    if pg is not None and torch.distributed.get_world_size(group) > 1:
        raise ValueError("openrlhf_drpo: batch_quantile over data-parallel ranks is not supported: an order "
                         "statistic of the batch needs every rank's values, which the ranks only sum (run on one "
                         "rank, or compute it into the advantages)")
    if level == "token":
        values, present = _selected(x, m, 0.0, like).reshape(-1), m.reshape(-1)
    else:
        values, count = _response_values(x, m, like)
        values, present = values.reshape(-1), count.reshape(-1) > 0
    n = present.sum()
    nan = (present & values.isnan()).any()
    if values.numel() == 0:             # no token: 0, still attached to x's graph
        zero = values.sum()
        return zero, zero, zero, n, nan
    rank = torch.full((), q, dtype=like.dtype, device=like.device) * (n - 1).clamp(min=0).to(like.dtype)
    below = rank.floor()
    order = torch.where(present, values, math.inf).detach().sort().values

    def neighbour(k):
        at = order.gather(0, k.long().reshape(1))
        return torch.where(present & (values <= at), values, -math.inf).amax()
    return neighbour(below), neighbour(rank.ceil()), rank - below, n, nan


def _batch_stat(out, n, nan, like):
    return torch.where(n > 0, torch.where(nan, math.nan, out), 0.0).expand_as(like)


def batch_quantile(x, m, like, pg, level, q):
    """torch.quantile(elements, q), linear: lerp(lower, upper, f) at f = q·(n − 1) − ⌊q·(n − 1)⌋, but
    where the neighbours are equal, their value (torch's lerp gives NaN for two equal infinities); NaN
    where an element is NaN; 0 over none."""
    low, high, frac, n, nan = _batch_order(x, m, like, pg, level, q)
    return _batch_stat(torch.where(low == high, low, torch.lerp(low, high, frac)), n, nan, like)


def batch_qlow(x, m, like, pg, level, q):      # batch_quantile's neighbours and weight (its adjoint's)
    low, _, _, n, nan = _batch_order(x, m, like, pg, level, q)
    return _batch_stat(low, n, nan, like)


def batch_qhigh(x, m, like, pg, level, q):
    _, high, _, n, nan = _batch_order(x, m, like, pg, level, q)
    return _batch_stat(high, n, nan, like)


def batch_qfrac(x, m, like, pg, level, q):
    frac, n = _batch_order(x, m, like, pg, level, q)[2:4]
    return torch.where(n > 0, frac, 0.0).expand_as(like)


def ref_topk_sum(x, m, like):
    # x: [k, B, T], an entry of the token's support per row (the generated code's layout, so that
    # a token's values broadcast over its entries); a masked token's sum is selected out by its reader
    return x.sum(0)


topk_sum = ref_topk_sum


# every reduction row's function, by the row's name, and every name the generated code may call
ROWS = {k: globals().get(k) for k, op in OPS.items() if op.reduce}
if not all(map(callable, ROWS.values())):
    raise TypeError("openrlhf_drpo.core.reductions must define a function for every reduction row, of its name: "
                    f"missing {sorted(k for k, f in ROWS.items() if not callable(f))}")
NAMESPACE = {f"_{k}": f for k, f in {**ROWS, "turn_len": turn_len}.items()}
