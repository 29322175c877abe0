"""The host-neutral loss core: a compiled objective as a torch loss, knowing no training framework.

    loss_fn = CompiledLoss("drpo", delta=0.2)     # shipped name, path or lang.Objective
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
from fractions import Fraction

import torch
from torch import nn

from openrlhf_drpo import lang
from openrlhf_drpo.core.codegen import compile_objective
from openrlhf_drpo.lang.objective import OPTIONS, Objective
from openrlhf_drpo.core.boundary import check_inputs
from openrlhf_drpo.core.kernels import (aggregation_coef, compute_dtype, eager_kernel, fused_function, kernel,
                                        mul_sum, per_token)
from openrlhf_drpo.core.measures import filtered_fraction, lab_extremes
from openrlhf_drpo.core.values import FILTERED, METRICS, Aggregation, LossMetrics, LossOutput


class CompiledLoss(nn.Module):
    """An objective compiled to a loss (see the module docstring). `fused=False` runs the plain
    autograd path (the reference for the fused one); `compile` chooses torch.compile for the
    fused kernel ("auto": on CUDA inputs). Keyword overrides name parameters (ASCII or Unicode)
    or the options `anchor` and `aggregate`. `self.metrics` is the last call's LossMetrics."""

    rollout_hint = ""      # how the host keeps rollout log-probs, for the error when it did not
    argument_names: dict = {}      # the host's names for forward's arguments, for its error messages

    def __init__(self, objective: str | Objective = "drpo", *, fused: bool = True, compile: bool | str = "auto",
                 **overrides):
        super().__init__()
        who = type(self).__name__
        _check_arguments(who, fused, compile, overrides)
        obj = objective if isinstance(objective, Objective) else lang.load(objective)
        options = {k: overrides.pop(k) for k in list(overrides) if k in OPTIONS}
        self.objective = obj.with_overrides(overrides, options, where=who) if (overrides or options) else obj
        self._value, self._value_and_grad, self._value_and_grad_eager, self.source = compile_objective(self.objective)
        self.fused = fused
        # "auto": torch.compile (inductor) on CUDA inputs, where compiling takes seconds; eager
        # on CPU, where it takes ~30 s per objective. True/False force it either way.
        self.compile = compile
        self._kernels: dict[tuple, object] = {}
        self.anchor = self.objective.options["anchor"]
        self.names = self.objective.names()
        self.uses_rollout = self.objective.reads_rollout()
        self.aggregate = self.objective.options["aggregate"]
        self.metrics: LossMetrics | None = None     # the last call's
        self.track_extremes = False        # drpo-lab: fill self.extremes on every call
        self.extremes: dict[str, float] = {}

    def inputs(self) -> dict:
        """The inputs beyond log π, μ's log-probs, the advantages and the mask that the objective
        reads, each with what in the objective reads it (the one list every host checks against)."""
        out = {}
        if self.uses_rollout:
            out["rollout_log_probs"] = "@anchor = rollout" if self.anchor == "rollout" else "π_rollout"
        return out

    def refuse_missing(self, missing: dict, who: str = "") -> None:
        """Refuse an objective that reads an input its host (or the host's configuration) does not
        provide: `missing` maps an input to how the host would provide it (what to set), and is
        checked at the host's construction, before any model loads."""
        for key, why in self.inputs().items():
            if key in missing:
                raise ValueError(f"{who + ': ' if who else ''}objective '{self.objective.name}' uses {why}, "
                                 f"but {missing[key]}")

    def extra_repr(self) -> str:
        return f"{self.objective.name}: {self.objective.canonical().splitlines()[-1]}, fused={self.fused}"

    def forward(self, log_probs, old_log_probs, advantages, mask=None, *, rollout_log_probs=None,
                aggregation: Aggregation | None = None) -> LossOutput:
        """(loss, metrics): the loss (its gradient by autograd) and its LossMetrics, aggregated as
        `aggregation` says (the objective's own @aggregate over the local count by default)."""
        agg = aggregation or Aggregation()
        if not isinstance(agg, Aggregation):
            raise TypeError(f"{type(self).__name__}: aggregation must be an Aggregation, got {type(agg).__name__}")
        weights = agg.weights
        check_inputs(type(self).__name__, self.argument_names,
                     {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages, "mask": mask,
                      "rollout_log_probs": rollout_log_probs, "weights": weights})
        if rollout_log_probs is None:
            self.refuse_missing({"rollout_log_probs": "no rollout log-probs were given" + self.rollout_hint})
        mode = agg.mode or self.aggregate
        if mode not in OPTIONS["aggregate"]:
            raise ValueError(f"{type(self).__name__}: aggregation {mode!r} is not one of {list(OPTIONS['aggregate'])}")
        anchor = rollout_log_probs if self.anchor == "rollout" else old_log_probs
        # the policies the objective names besides μ (None where it names none: nothing to compute)
        old = old_log_probs.detach() if "pi_old" in self.names else None
        rollout = rollout_log_probs.detach() if "pi_rollout" in self.names else None
        if mask is None:
            mask = torch.ones_like(log_probs, dtype=torch.bool)
        # the global normalizer, as a tensor so a compiled kernel does not specialize on it
        # (in the kernel's precision: a bf16 count of 1234 would read 1232)
        norm = agg.norm
        if norm is not None:
            norm = torch.as_tensor(norm, dtype=compute_dtype(log_probs), device=log_probs.device)
        fused = self._fused(log_probs, mode, mask, norm, weights if self.fused else None)
        if self.fused:
            loss, stats = fused.apply(log_probs, anchor, advantages, mask, norm, old, rollout, weights)
        else:
            anchor, advantages = anchor.detach(), advantages.detach()
            keep = mask != 0
            clean = lambda x: x if x is None else torch.where(keep, x, 0.0)   # noqa: E731  select, don't multiply
            per_token = -self._value(clean(log_probs), clean(anchor), clean(advantages), clean(old), clean(rollout),
                                     keep)
            coef, count = aggregation_coef(keep.to(per_token.dtype), mode)
            if weights is not None:
                coef = coef * clean(weights.detach())
            loss = torch.where(keep, per_token, 0.0).mul(coef).sum() / (count.clamp(min=1) if norm is None else norm)
            loss = torch.where(keep.any(), loss, 0.0)    # all masked: 0, as the fused path defines it
            with torch.no_grad():
                stats = fused.apply(log_probs.detach(), anchor, advantages, mask, norm, old, rollout)[1]
        with torch.no_grad():
            fields = METRICS
            if self._value.filtered is not None:     # in the same tensor: still one host sync
                filtered = filtered_fraction(self._value, log_probs, anchor, advantages, old, rollout, mask != 0)
                stats, fields = torch.cat([stats, filtered.to(stats.dtype).reshape(1)]), METRICS + (FILTERED,)
            self.metrics = LossMetrics(stats, fields)
            if self.track_extremes:
                self.extremes = lab_extremes(self._value_and_grad, log_probs, anchor, advantages, mask != 0, old, rollout,
                                             mode)
        return LossOutput(loss, self.metrics)

    def _fused(self, logp, mode: str, mask, norm, weights):
        """The autograd Function around the (possibly compiled) kernel, built once per mode and,
        compiled, once per call signature (dtypes, device, which optional inputs are given): each
        has a code object, and so a compile cache, of its own (see fused_kernel)."""
        use = self.compile is True or (self.compile == "auto" and logp.is_cuda)
        key = (mode,) if not use else (mode, compute_dtype(logp), mask.dtype, logp.device.type, norm is None,
                                        weights is None)
        if (use, key) not in self._kernels:
            run = fused_kernel(self._value_and_grad, self._value_and_grad_eager, mode, use,
                               f"_kernel_{self.objective.name}_{len(self._kernels)}", self.objective.name)
            self._kernels[use, key] = fused_function(run, type(self).__name__)
        return self._kernels[use, key]


COMPILE_OPTIONS = {"dynamic": True}     # torch.compile's, for every compiled kernel


def _own_code(fn, name):
    """fn with a code object of its own (named `name`): dynamo keeps its graphs per code object."""
    code = fn.__code__.replace(co_name=name)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _fallback_warned(compiled, eager, objective: str):
    """compiled(...), or eager(...) with one warning naming the objective once dynamo would fall
    back silently (its recompile limit reached: more shapes than a cache holds)."""
    state = {"fn": compiled}

    def run(*args):
        if state["fn"] is compiled:
            # set and restored around the call (config.patch costs ~140 µs a call, this ~9)
            config, before = torch._dynamo.config, torch._dynamo.config.fail_on_recompile_limit_hit
            config.fail_on_recompile_limit_hit = True
            try:
                return compiled(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                warnings.warn(f"objective '{objective}': torch.compile reached its recompile limit "
                              f"({torch._dynamo.config.recompile_limit} graphs for this call signature); its "
                              "fused kernel runs uncompiled from now on", RuntimeWarning, stacklevel=4)
                state["fn"] = eager
            finally:
                config.fail_on_recompile_limit_hit = before
        return state["fn"](*args)
    return run


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


def fused_kernel(value_and_grad, value_and_grad_eager, mode: str, compiled: bool, code_name: str, objective: str):
    """The kernel for one mode: eager (CPU), or compiled with a code object of its own. Dynamo
    keeps at most recompile_limit (8) graphs per code object, and one shared kernel ran every
    objective after the third uncompiled; now only shapes vary within a cache (0/1-sized
    dimensions are specialized: a batch of 1 adds a graph, a new sequence length none)."""
    if not compiled:
        return functools.partial(eager_kernel, value_and_grad_eager, value_and_grad, mode)
    # the function itself is compiled, not a partial of it: dynamo would compile the wrapper
    # that calls a partial, whose code every objective shares
    own = _own_code(kernel, re.sub(r"\W", "_", code_name))
    bind = lambda f: functools.partial(f, value_and_grad, mode, dot=mul_sum)   # noqa: E731
    return _fallback_warned(bind(torch.compile(own, **COMPILE_OPTIONS)), bind(own), objective)
