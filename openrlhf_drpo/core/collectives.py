"""The batch reductions' sums over the data-parallel ranks, as the generated code reads them (its
`pg`: a function summing a tensor over the ranks, or None). Every rank must issue the same
collectives in the same order, whatever its values (a NaN in a masked slot, no token at all): so
a second evaluation of the same code on the same inputs (the eager kernel's exact fallback, the
sync-free backward's recomputation) replays the first one's totals instead of all-reducing again."""
from __future__ import annotations

from dataclasses import replace

import torch


class RankSums:
    """One evaluation's sums over the ranks of `group`: each total all-reduced and kept in
    `totals`, in the order the code asks for them; or, with `replay` (an earlier evaluation's
    totals), those handed back in order, with no collective. `differentiable`: the all-reduce
    carries autograd (the plain path, whose gradient autograd takes through it)."""

    def __init__(self, group, replay=None, differentiable=False):
        self.group, self.replay, self.differentiable = group, replay, differentiable
        self.totals: list[torch.Tensor] = []

    def __call__(self, t):
        if self.replay is not None:
            i = len(self.totals)
            if i >= len(self.replay) or self.replay[i].shape != t.shape:
                # the replayed code asked for other sums than the first evaluation: an internal error, never silent
                raise RuntimeError(f"openrlhf_drpo: the batch reductions' replayed sum {i} is {list(t.shape)}, but "
                                   f"the first evaluation all-reduced {[list(x.shape) for x in self.replay]}")
            t = self.replay[i]
        elif self.differentiable:
            import torch.distributed.nn.functional as distributed
            t = distributed.all_reduce(t, group=self.group)
        else:
            t = t.clone()
            torch.distributed.all_reduce(t, group=self.group)
        self.totals.append(t)
        return t


def rank_sums(b, replay=None, differentiable=False):
    """(b, sums): the generated code's TokenBatch with its process group replaced by a RankSums
    over it (replaying `replay` where given), and that RankSums; b as it is, and None, where no
    batch reduction sums over ranks (or, without `replay`, b's is a RankSums already: the caller's)."""
    group = b.pg
    if group is None or (isinstance(group, RankSums) and replay is None):
        return b, group
    if isinstance(group, RankSums):
        group = group.group
    sums = RankSums(group, replay, differentiable)
    return replace(b, pg=sums), sums


def replayed(sums: RankSums | None):
    """The totals a first evaluation kept (an empty list where nothing was summed over ranks)."""
    return [] if sums is None else sums.totals
