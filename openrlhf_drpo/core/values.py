"""The loss core's typed values: how per-token terms become the loss (Aggregation), a call's
tensors (TokenBatch), a compiled objective (Generated), and what a call returns (LossOutput: the
loss and its LossMetrics, each metric declared once in METRICS)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

import torch

from dsl.controls import STEP
from dsl.names import display_name

if TYPE_CHECKING:
    from dsl.objective import Objective


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


@dataclass(frozen=True)
class TokenBatch:
    """One loss call's tensors, built and checked once at the tensor boundary (CompiledLoss.batch)
    and passed whole to the kernels, the generated code (its `b`), the metrics and drpo-lab's
    extremes. Per-token fields are [batch, tokens] on log π's device; None: not read by the
    objective (or not given). The loss core only derives new ones from it (widened, detached,
    selected, flat), never re-checks them."""
    logp: torch.Tensor                       # log π, with its gradient
    anchor: torch.Tensor                     # log μ: log π_old, or log π_rollout where @anchor = rollout
    A: torch.Tensor                          # the advantages
    mask: torch.Tensor                       # as given: bool, or integer/floating 0/1 (kernels read mask != 0)
    old: torch.Tensor | None = None          # log π_old, detached, where the objective names π_old
    rollout: torch.Tensor | None = None      # log π_rollout, detached, where it names π_rollout
    ref: torch.Tensor | None = None          # log π_ref, detached (the third version's inputs, from here ...)
    entropy: torch.Tensor | None = None      # H, attached to the policy's graph (its own gradient channel)
    sum_pi_sq: torch.Tensor | None = None    # Σ_v π_v², detached
    group: torch.Tensor | None = None        # [batch]: each response's group's first response (... to here)
    turns: torch.Tensor | None = None        # integer turn ids, [batch, tokens] (the fourth version's inputs ...)
    staleness: torch.Tensor | None = None    # policy versions behind, detached (... to here)
    weights: torch.Tensor | None = None      # a host's per-token factors in the sum (Aggregation.weights)
    norm: torch.Tensor | None = None         # 0-d: the global normalizer, in the compute dtype
    mode: str = "token-mean"                 # the aggregation (an @aggregate value)
    pg: object = None                        # the batch reductions' process group (or a RankSums over it)
    rank_fold: bool = False                  # each rank's 1/N is folded into weights (core.loss._fold_ranks)
    # the fourth version's vocabulary support, [batch, tokens, k] (ENTRIES): log π of each entry, attached to
    # the policy's graph (its own gradient channel), and log π_ref's (a teacher's) of the same entries, detached
    vocab_logp: torch.Tensor | None = None
    vocab_ref: torch.Tensor | None = None

    def tensors(self) -> tuple:
        """The tensor fields in TENSORS' order (None where absent)."""
        return tuple(getattr(self, name) for name in TENSORS)

    def with_tensors(self, tensors: Iterable[torch.Tensor | None]) -> TokenBatch:
        """This batch with its tensor fields replaced, in TENSORS' order."""
        return replace(self, **dict(zip(TENSORS, tensors)))

    def detached(self) -> TokenBatch:
        """This batch without autograd history (each field that requires a gradient, detached)."""
        return self._changed({name: x.detach() for name in TENSORS
                              if (x := getattr(self, name)) is not None and x.requires_grad})

    def widened(self, dtype: torch.dtype) -> TokenBatch:
        """Every floating field but the mask in the compute dtype (compiled, the casts fuse into the loads)."""
        return self._changed({name: x.to(dtype) for name in _FLOATS
                              if (x := getattr(self, name)) is not None and x.dtype != dtype})

    def _changed(self, changes: dict) -> TokenBatch:
        # the batch itself where nothing changes: a replace costs ~5 µs, and the CPU's eager kernel
        # runs a small batch in ~300 µs
        return replace(self, **changes) if changes else self

    def selected(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenBatch:
        """fn applied to each per-token input the generated code reads (log π, μ, A, the policies,
        the third version's per-token inputs, the support's entries with k moved first so that a
        [B, T] selection broadcasts over them): a selection by the mask, a cast."""
        return replace(self, **{name: fn(x) if name not in ENTRIES else fn(x.movedim(-1, 0)).movedim(0, -1)
                                for name in _READ if (x := getattr(self, name)) is not None})

    def flat(self) -> TokenBatch:
        """The generated code's per-token inputs as flat vectors (the eager kernel's, for an objective
        that never reads a whole response, nor the third version's inputs)."""
        return replace(self, **{name: x.reshape(-1) for name in _READ if (x := getattr(self, name)) is not None})


# the tensor fields, in their order (the annotations are strings: `from __future__ import annotations`)
TENSORS = tuple(f.name for f in fields(TokenBatch) if f.type.startswith("torch.Tensor"))
ENTRIES = ("vocab_logp", "vocab_ref")       # [B, T, k]: one value per entry of the token's support
_READ = ("logp", "anchor", "A", "old", "rollout", "ref", "entropy", "sum_pi_sq", "staleness") + ENTRIES
_FLOATS = _READ + ("weights", "norm")


@dataclass(frozen=True)
class Generated:
    """One compiled objective (codegen.compile_objective): its generated callables, each taking a
    TokenBatch `b`, and every fact about them that the kernels, the metrics and the loss read,
    declared here once (no attribute on a function object)."""
    value: Callable                  # value(b, m): ℓ per token, under autograd (the plain path)
    value_and_grad: Callable         # value_and_grad(b, m, coef): ℓ, ∂ℓ/∂log π, r, raw, μ, keep (then d/dH)
    value_and_grad_eager: Callable   # the same, for eager CPU execution on b.flat() (where not `reduces`)
    filtered: Callable | None        # filtered(b, m): 1 where the objective's filters drop a token; None: none
    source: str = field(repr=False)  # the generated torch code (drpo-analyze --emit-torch)
    includes_coef: bool              # value_and_grad's gradient is that of Σ coef·ℓ (the reverse mode)
    reduces: bool                    # it reads whole responses or the third version's inputs: never flattened
    third_version: bool              # it reads the TokenBatch's ref, entropy, sum_pi_sq, group or pg
    filtered_per_response: bool      # a filter reads a whole response (the filtered fraction counts responses)
    # the inputs with a gradient channel of their own, in the order value_and_grad returns their
    # gradients after keep: "entropy" (H), "vocab_logp" (the support's log π, [B, T, k])
    channels: tuple = ()
    batch_depth: int = 0             # how deeply batch reductions nest (BatchStatistics' no-grad passes)


# the third version's inputs: forward's argument, the built-in that reads it, what the objective uses
_INPUTS = {"ref_log_probs": ("pi_ref", "π_ref"), "entropy": ("H", "H (the entropy, with its gradient)"),
           "sum_pi_sq": ("sum_pi_sq", "sum_π_sq (Σ_v π_v²)"),
           "staleness": ("staleness", "staleness (each token's policy versions behind the current one)"),
           "vocab_log_probs": ("pi_v", "π_v (the policy's log-probs on each token's top-k support, with their gradient)"),
           "vocab_ref_log_probs": ("pi_ref_v", "π_ref_v (π_ref's or a teacher's log-probs on each token's top-k support)")}
_WHOLE = {"groups": ("group", "each prompt's responses whole in one loss call, with their group ids"),
          "batch": ("batch", "the optimizer step's whole batch, in one loss call or through batch_statistics() over its micro-batches")}
INPUT_NOT_GIVEN = {"rollout_log_probs": "no rollout log-probs were given",
              "ref_log_probs": "no reference log-probs were given (ref_log_probs=)",
              "entropy": "no entropy was given (entropy=, attached to the policy's graph)",
              "sum_pi_sq": "no Σ_v π_v² was given (sum_pi_sq=)",
              "groups": "no group ids were given (groups=, one per response)",
              "turns": "no turn ids were given (turns=, one per token)",
              "staleness": "no staleness was given (staleness=, one per token)",
              "vocab_log_probs": "no support log-probs were given (vocab_log_probs=, [B, T, k], attached to the policy's graph)",
              "vocab_ref_log_probs": "no reference support log-probs were given (vocab_ref_log_probs=, [B, T, k])"}


def objective_inputs(obj: Objective) -> dict:
    """CompiledLoss.inputs(): each input beyond the four every objective reads, and each thing a
    loss call must hold whole, with what in the objective needs it."""
    out, names, whole = {}, obj.names(), obj.facts.kept_whole
    if obj.reads_rollout():
        out["rollout_log_probs"] = "@anchor = rollout" if obj.options["anchor"] == "rollout" else "π_rollout"
    out.update({key: what for key, (name, what) in _INPUTS.items() if name in names})
    turn = sorted({n.op for n in obj.expr.walk() if n.op.startswith("turn_")} | ({"turn_len"} & names))
    if turn:
        out["turns"] = f"{', '.join(turn)} (each token's turn id within its response)"
    for key, (over, what) in _WHOLE.items():
        if key in whole:
            used = sorted({n.op for n in obj.expr.walk() if n.op.startswith(f"{over}_")})
            out[key] = f"{', '.join(used)} ({what})"
    if obj.controls or STEP in obj.params:     # not a tensor: a host that keeps the state across steps
        held = [display_name(k) for k in obj.controls] + [STEP] * (STEP in obj.params)
        out["memory"] = (f"{', '.join(held)} (state kept across optimizer steps: updated once after each step "
                         "with the same value on every rank, logged, saved with the checkpoint and restored)")
    return out
