"""The loss core's typed values: how per-token terms become the loss (Aggregation), and what a
call returns (LossOutput: the loss and its LossMetrics, each metric declared once in METRICS)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


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
    in the sum, not the count (verl's rollout IS weights, TRL's per-response normalization);
    `process_group` (a torch.distributed process group) is the data-parallel ranks the batch
    reductions (batch_sum, batch_mean, batch_count) sum over, by an all-reduce with autograd
    (None: the call's own batch alone)."""
    mode: str | None = None
    norm: float | torch.Tensor | None = None
    weights: torch.Tensor | None = None
    process_group: object = None
