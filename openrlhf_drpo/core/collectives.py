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
        elif isinstance(self.group, BatchStatistics):      # the step's totals (BatchStatistics)
            t = self.group(t)
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


class BatchStatistics:
    """The batch reductions of an optimizer step of several micro-batches (and ranks), exact: the
    step's totals of every sum the generated code asks for (its `pg`), in a host's no-grad passes
    over the step's micro-batches, then handed to each micro-batch's training call. A call's sums
    come in an order its configuration fixes (the code is straight-line), so the i-th sum of every
    call is the same statistic; a sum whose argument reads another (the reverse mode's adjoint of a
    batch_mean reads the step's own totals, λ = Σ ∂f/∂S) is exact after as many passes as sums nest
    (`passes`, Generated.batch_depth). The fused kernels compute the gradient from these totals in
    reverse mode: a token's gradient then includes λ·∂g/∂x, with no pass beyond the no-grad ones.

        stats = loss.batch_statistics(process_group)       # None: no batch reduction
        for _ in stats.recording():                        # `passes` times
            with torch.no_grad():
                for mb in step: loss(..., aggregation=Aggregation(..., process_group=stats))
        for mb in step: loss(..., aggregation=Aggregation(..., process_group=stats)).backward()

    Each pass ends with one all-reduce of all its totals over `group` (shapes fixed, never values)."""

    def __init__(self, group=None, passes: int = 1):
        self.group, self.passes = group, passes
        self.totals: list | None = None      # the last finished pass's step totals
        self.pending: list | None = None     # the running pass's sums (None: training calls)
        self.cursor = 0
        self.calls = 0

    def begin(self) -> None:
        """A loss call starts (CompiledLoss.forward): its sums are numbered from 0 again."""
        self._check_call()
        self.cursor = 0
        self.calls += 1

    def recording(self):
        """The no-grad passes: each iteration the host runs every micro-batch's loss once (no
        backward), then the pass's sums are all-reduced into the step's totals."""
        for p in range(self.passes):
            self.pending, self.calls = [], 0
            yield p
            self._check_call()
            if self.calls == 0:
                raise RuntimeError("openrlhf_drpo: a batch-statistics pass ran no loss call on this rank; every "
                                   "rank runs each micro-batch of its step once per pass")
            flat = torch.cat([t.reshape(-1) for t in self.pending])
            if self.group is not None:
                torch.distributed.all_reduce(flat, group=self.group)
            self.totals = list(flat.split([t.numel() for t in self.pending]))
            self.totals = [t.view_as(p) for t, p in zip(self.totals, self.pending)]
            self.pending, self.calls = None, 0

    def __call__(self, t):
        i = self.cursor
        self.cursor += 1
        if self.pending is not None:
            if self.calls == 1 and i == len(self.pending) and (self.totals is None or i < len(self.totals)):
                self.pending.append(t.detach().clone())
            elif i < len(self.pending) and self.pending[i].shape == t.shape:
                self.pending[i] += t.detach()
            else:
                self._mismatch(i, t)
            return t if self.totals is None else self.totals[i]      # the previous pass's, once there is one
        if self.totals is None:
            raise RuntimeError("openrlhf_drpo: a loss call took BatchStatistics before any recording pass: run "
                               "`for _ in stats.recording(): ...` over the step's micro-batches first")
        if i >= len(self.totals) or self.totals[i].shape != t.shape:
            self._mismatch(i, t)
        return self.totals[i]

    def _check_call(self):
        known = len(self.pending) if self.pending is not None else len(self.totals or [])
        if self.calls and self.cursor != known:
            self._mismatch(self.cursor, None)

    def _mismatch(self, i, t):
        # an internal error or a host that changed the call's configuration within a step: never silent
        known = self.pending if self.pending is not None else self.totals
        raise RuntimeError(f"openrlhf_drpo: a loss call asked for batch sum {i}" + (f" of shape {list(t.shape)}"
                           if t is not None else f" sums in all") + f", but the step's first call asked for "
                           f"{[list(x.shape) for x in known or []]}: every micro-batch's loss call must have the "
                           "same configuration (mask dtype, host weights, path)")
