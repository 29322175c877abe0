"""The host-neutral loss core: a compiled objective as a torch loss, knowing no training framework.

    loss_fn = CompiledLoss("drpo", delta=0.2)     # shipped name, path or an Objective
    loss, metrics = loss_fn(log_probs, old_log_probs, advantages, mask)
    loss.backward(); metrics.floats()             # {"drpo_w_mean": ..., ...}: one host sync

Inputs are per-token [B, T]: log π (with grad), μ's log-probs (π_old; π_rollout comes separately and
is the anchor where the objective says `@anchor = rollout`), advantages and a mask. How per-token terms
become the loss is one `Aggregation` (mode, global normalizer, per-token weights) that a host builds
and both paths (fused and plain) consume. The metrics come back as a `LossMetrics` record: named 0-d
views of one stacked tensor. Each host adapter (openrlhf_drpo.hosts.openrlhf.loss, .trl, .verl) maps its framework's
names onto these; this module imports torch, numpy, sympy and lark only."""
from __future__ import annotations

import functools
import re
import types
import warnings
from dataclasses import replace
from fractions import Fraction

import torch
from torch import Tensor, nn

import dsl
from dsl.vocabulary import support
from openrlhf_drpo.core.codegen import compile_objective
from openrlhf_drpo.core.collectives import BatchStatistics, rank_sums
from openrlhf_drpo.core.batch import token_batch
from openrlhf_drpo.core.controls import Controller, reading
from openrlhf_drpo.core.hosting import HostCalls
from dsl.controls import STEP
from dsl.objective import OPTIONS, Objective
from openrlhf_drpo.core.boundary import refuse_bad_mask
from openrlhf_drpo.core.kernels import (aggregation_coef, denominator, eager_kernel, fused_function,
                                        grad_kernel, loss_kernel, mul_sum, recomputing_function)
from openrlhf_drpo.core.measures import filtered_fraction, lab_extremes
from openrlhf_drpo.core.values import (FILTERED, METRICS, Aggregation, LossMetrics, LossOutput, TokenBatch,
                                      objective_inputs)

OptTensor = Tensor | None      # an input a call may leave out


class CompiledLoss(HostCalls, nn.Module):
    """An objective compiled to a loss (see the module docstring). `fused=False` runs the plain
    autograd path (the reference for the fused one); `compile` chooses torch.compile for the
    fused kernel ("auto": on CUDA inputs). Keyword overrides name parameters (ASCII or Unicode)
    or the options `anchor` and `aggregate`. `self.metrics` is the last call's LossMetrics."""

    def __init__(self, objective: str | Objective = "drpo", *, fused: bool = True, compile: bool | str = "auto",
                 **overrides):
        super().__init__()
        who = type(self).__name__
        _check_arguments(who, fused, compile, overrides)
        obj = objective if isinstance(objective, Objective) else dsl.load(objective)
        options = {k: overrides.pop(k) for k in list(overrides) if k in OPTIONS}
        self.objective = obj.with_overrides(overrides, options, where=who) if (overrides or options) else obj
        self.generated = compile_objective(self.objective)     # the generated functions and their facts
        self.source = self.generated.source
        # an objective with memory (dsl.controls): its state, updated by end_step() (None: it has none)
        self.controller = Controller(self.objective) if self.objective.controls or STEP in self.objective.params \
            else None
        self.fused = fused
        # "auto": torch.compile (inductor) on CUDA inputs, where compiling takes seconds; eager
        # on CPU, where it takes ~30 s per objective. True/False force it either way.
        self.compile = compile
        self._kernels: dict[tuple, object] = {}
        self.anchor = self.objective.options["anchor"]
        self.names = self.objective.names()
        self.reads = reading(self.objective).names()     # and what its update rules' statistics read
        self.uses_rollout = self.objective.reads_rollout()
        self.kept_whole = reading(self.objective).facts.kept_whole     # (its rules' statistics' groups too)
        self.support = support(self.objective.expr)    # whose top-k the vocabulary sums read (None: no such sum)
        for text in self.objective.by_position():       # a silent surprise otherwise: [1.5, 0, 0] for [1.5, 1.5, 1.5]
            warnings.warn(f"{who}: objective '{self.objective.name}': {text}", stacklevel=2)
        self._inputs = objective_inputs(reading(self.objective))
        refuse_unprovided(self)      # a host's: what it never provides
        self.aggregate = self.objective.options["aggregate"]
        self.metrics: LossMetrics | None = None     # the last call's
        self.track_extremes = False        # drpo-lab: fill self.extremes on every call (it reads them on the host)
        # On CUDA no path syncs with the host; on the CPU the uncompiled fused kernel is the eager one,
        # which reads its metrics on the host once a call (a measured speed-up). True: the CUDA path
        # on every device (tests hold it sync-free on the CPU).
        self.sync_free = False
        self.extremes: dict[str, float] = {}

    def extra_repr(self) -> str:
        return f"{self.objective.name}: {self.objective.canonical().splitlines()[-1]}, fused={self.fused}"

    def forward(self, log_probs: Tensor, old_log_probs: OptTensor, advantages: Tensor, mask: OptTensor = None, *,
                rollout_log_probs: OptTensor = None, ref_log_probs: OptTensor = None, entropy: OptTensor = None,
                sum_pi_sq: OptTensor = None, groups: OptTensor = None, turns: OptTensor = None,
                staleness: OptTensor = None, aggregation: Aggregation | None = None, vocab_log_probs: OptTensor = None,
                vocab_ref_log_probs: OptTensor = None) -> LossOutput:
        """(loss, metrics): the loss (its gradient by autograd, to log π and to `entropy` and
        `vocab_log_probs` where the objective reads them) and its LossMetrics, aggregated as
        `aggregation` says (the objective's own @aggregate over the local count by default). The
        inputs beyond the four, [B, T] but groups [B] and the vocab_ ones [B, T, k]: docs/api.md."""
        b = self.batch(log_probs, old_log_probs, advantages, mask, rollout_log_probs=rollout_log_probs,
                       ref_log_probs=ref_log_probs, entropy=entropy, sum_pi_sq=sum_pi_sq, groups=groups,
                       turns=turns, staleness=staleness, aggregation=aggregation, vocab_log_probs=vocab_log_probs,
                       vocab_ref_log_probs=vocab_ref_log_probs)
        if isinstance(b.pg, BatchStatistics):
            b.pg.begin()
        compiled, sync_free = self._path(b.logp)
        fused = self._fused(compiled, sync_free, b)
        if self.fused:
            # torch.autograd.Function.apply links the loss to the tensors it is given positionally,
            # and only to those (log π and H carry gradients): so the batch's tensors are unpacked
            # here, once, in TokenBatch's field order, beside the batch the kernels read
            loss, stats = fused.apply(b, *b.tensors())
        else:
            b = replace(b, anchor=b.anchor.detach(), A=b.A.detach())
            loss = plain_loss(self.generated, b)
            with torch.no_grad():
                seen = replace(b, weights=None).detached()      # the metrics, without the host's weights
                stats = fused.apply(seen, *seen.tensors())[1]
        self.metrics = call_metrics(self, stats, b)
        if self.controller is not None and torch.is_grad_enabled():     # a training call: its statistics count
            self.controller.observe(b, self.objective.params)
        return LossOutput(loss, self.metrics)

    def batch(self, log_probs: Tensor, old_log_probs: OptTensor, advantages: Tensor, mask: OptTensor = None,
              **inputs) -> TokenBatch:
        """forward's arguments as the TokenBatch its kernels take, each checked here once (token_batch)."""
        return token_batch(self, log_probs, old_log_probs, advantages, mask, **inputs)

    def _path(self, logp) -> tuple[bool, bool]:
        """(compiled, sync_free): torch.compile's kernels ("auto": on CUDA), and the sync-free kernels
        (on CUDA, compiled, or self.sync_free on any device) rather than the CPU's eager kernel."""
        # with memory the objective is recompiled at each step's values: "auto" does not torch.compile it
        compiled = self.compile is True or (self.compile == "auto" and logp.is_cuda and self.controller is None)
        return compiled, compiled or logp.is_cuda or self.sync_free

    def _fused(self, use: bool, sync_free: bool, b: TokenBatch):
        """The autograd Function around the kernels (build_kernels), built once per mode and,
        compiled, once per call signature (dtypes, device, which optional inputs are given: the
        plain path's metrics take no weights)."""
        weightless = b.weights is None or not self.fused
        key = (b.mode,) if not use else (b.mode, b.logp.dtype, b.mask.dtype, b.logp.device.type, b.norm is None,
                                         weightless)
        if (use, sync_free, key) not in self._kernels:
            self._kernels[use, sync_free, key] = build_kernels(self, use, sync_free,
                                                               f"{self.objective.name}_{len(self._kernels)}")
        return self._kernels[use, sync_free, key]


@torch.no_grad()
def call_metrics(loss: CompiledLoss, stats, b: TokenBatch) -> LossMetrics:
    """A call's LossMetrics: the kernels' stats, and the fraction the objective's filters drop in
    the same tensor (still one host sync); drpo-lab's extremes into loss.extremes where tracked."""
    fields = METRICS
    if loss.generated.filtered is not None:
        filtered = filtered_fraction(loss.generated, b)
        stats, fields = torch.cat([stats, filtered.to(stats.dtype).reshape(1)]), METRICS + (FILTERED,)
    if loss.track_extremes:
        loss.extremes = lab_extremes(loss.generated, b)
    return LossMetrics(stats, fields)


def build_kernels(loss: CompiledLoss, use: bool, sync_free: bool, tag: str):
    """The autograd Function for one call signature. Compiled, each kernel has code objects, and
    so compile caches, of its own (its forward's and its backward's): dynamo keeps at most
    recompile_limit (8) graphs per code object, and one shared kernel ran every objective after
    the third uncompiled; now only shapes vary within a cache (0/1-sized dimensions are
    specialized: a batch of 1 adds a graph, a new sequence length none). Without CUDA or
    compile=True (or sync_free), the CPU's eager kernel."""
    who = type(loss).__name__
    # an objective that never reads r gets its metrics' ratio clamped (kernels.RATIO_RANGE)
    clamp = "r" not in loss.names
    if not sync_free:
        return fused_function(functools.partial(eager_kernel, loss.generated, clamp_ratio=clamp), who)
    forward, backward = loss_kernel, grad_kernel
    if use:
        # each function itself is compiled, not a partial of it: dynamo would compile the
        # wrapper that calls a partial, whose code every objective shares
        forward, backward = _compiled_or_warned(
            *[_own_code(f, re.sub(r"\W", "_", f"_{f.__name__}_{tag}")) for f in (forward, backward)],
            loss.objective.name)
    # compiled, a product's sum is fused into the loop (a dot is a separate BLAS call)
    forward = functools.partial(forward, loss.generated, clamp_ratio=clamp, **({"dot": mul_sum} if use else {}))
    backward = functools.partial(backward, loss.generated)
    refuse = functools.partial(refuse_bad_mask, who, loss.argument_names)
    return recomputing_function(forward, backward, refuse, who)


# torch.compile's, for every compiled kernel. Inductor stores a per-token value that several sums
# read (or that reads several inputs) rather than recompute it: a buffer the size of the gradient
# written and read back, in a kernel bound by memory. Ours are such sums: inlined, the forward
# writes no per-token tensor (ppo, drpo: none; a sequence objective's reductions still store some).
COMPILE_OPTIONS = {"dynamic": True, "options": {"realize_opcount_threshold": 300, "realize_reads_threshold": 64,
                                                "realize_acc_reads_threshold": 64}}


def plain_loss(generated, b: TokenBatch):
    """The plain path: the generated per-token objective under autograd, aggregated as the fused
    kernels are (the reference they are held to); H keeps its graph."""
    keep = b.mask != 0
    clean = lambda x: x if x is None else torch.where(keep, x, 0.0)   # noqa: E731  select, don't multiply
    b, _ = rank_sums(b, differentiable=True)      # autograd takes the gradient through the all-reduce
    per_token = -generated.value(b.selected(clean), keep)
    coef, count = aggregation_coef(keep.to(per_token.dtype), b.mode)
    if b.weights is not None:
        coef = coef * clean(b.weights.detach())
    loss = torch.where(keep, per_token, 0.0).mul(coef).sum() / denominator(count, b.norm)
    return torch.where(keep.any(), loss, 0.0)    # all masked: 0, as the fused path defines it


def refuse_unprovided(loss: CompiledLoss, config=None) -> None:
    """A host's one refusal, at its construction (before any model loads) and again where its
    configuration comes later (TRL's default config, drpo-train's command line): every input the
    objective reads that the host does not declare in `provides` (fail closed: an undeclared one
    too), or that its configuration withholds (`lacks(config)`), by name, with why."""
    if loss.provides is None:
        return
    who = loss.host or type(loss).__name__
    missing = {key: f"{who} does not provide it ({type(loss).__name__}.provides declares no {key!r})"
               for key in loss.inputs() if key not in loss.provides}
    loss.refuse_missing({**missing, **loss.lacks(config)}, loss.host)


def _check_arguments(who: str, fused, compile, overrides: dict) -> None:
    if not isinstance(fused, bool):
        raise TypeError(f"{who}: fused must be True or False, got {fused!r}")
    if not (isinstance(compile, bool) or compile == "auto"):
        raise TypeError(f"{who}: compile must be True, False or 'auto', got {compile!r}")
    for name, value in overrides.items():
        # a tensor or array would be read at its own precision (float32 0.2 is 0.200000003)
        if name not in OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float, str, Fraction))):
            raise TypeError(f"{who}: parameter {name}={value!r} must be a Python number or a numeric "
                            f"string, not {type(value).__name__}; pass float(...) of it")


def _own_code(fn, name):
    """fn with a code object of its own (named `name`): dynamo keeps its graphs per code object."""
    code = fn.__code__.replace(co_name=name)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _compiled_or_warned(forward, backward, objective: str):
    """forward and backward compiled, each falling back to itself uncompiled, both together, with
    one warning naming the objective, once dynamo would fall back silently (its recompile limit
    reached: more shapes than a cache holds). Backward takes the shapes forward took, so only
    forward is watched (the watch costs ~7 µs a call)."""
    state = {"compiled": True}
    compiled_forward, compiled_backward = (torch.compile(f, **COMPILE_OPTIONS) for f in (forward, backward))

    def run_forward(*args, **kwargs):
        if state["compiled"]:
            config, before = torch._dynamo.config, torch._dynamo.config.fail_on_recompile_limit_hit
            config.fail_on_recompile_limit_hit = True
            try:
                return compiled_forward(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                warnings.warn(f"objective '{objective}': torch.compile reached its recompile limit "
                              f"({torch._dynamo.config.recompile_limit} graphs for this call signature); its "
                              "fused kernel runs uncompiled from now on", RuntimeWarning, stacklevel=4)
                state["compiled"] = False
            finally:
                config.fail_on_recompile_limit_hit = before
        return forward(*args, **kwargs)

    def run_backward(*args, **kwargs):
        return (compiled_backward if state["compiled"] else backward)(*args, **kwargs)
    return run_forward, run_backward
