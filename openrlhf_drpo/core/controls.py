"""A compiled objective's memory (dsl.controls): the step counter, the controlled parameters' values
and the finished step's statistics, held by CompiledLoss for any host:

    loss = CompiledLoss("adaptive_kl")
    for step in ...:
        for mb in micro_batches: loss(...).loss.backward()      # each training call adds its statistics
        optimizer.step()
        values = loss.end_step(process_group)                    # {"drpo_beta": ..., "drpo_step": ...}
    torch.save(loss.control_state(), ...); loss.load_control_state(...)    # with the host's checkpoint

A training call (autograd enabled) adds its float64 (sum, count) of each statistic to the step's;
end_step sums them over the ranks in one all-reduce of a fixed shape, so every rank computes the same
update from the same numbers, and the statistic of a step split into micro-batches is that of the
whole batch. The update is applied after the optimizer step: the step's loss read the values from
before it. The objective is then recompiled at the new values (a few ms; every path and the analysis
read an ordinary parameter)."""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from dsl.controls import STEP, statistics, next_values
from dsl.ir import Node
from dsl.levels import facts
from dsl.names import display_name
from dsl.objective import Objective
from openrlhf_drpo.core.codegen import function_source, reductions_import
from openrlhf_drpo.core.rewrites import annotate_levels, rewrite_logs, select_masks

STATE_VERSION = 1


class Controller:
    """The state of one CompiledLoss's objective with memory (see the module docstring)."""

    def __init__(self, objective: Objective):
        self.base = objective            # the objective at its values of the first step
        self.stats = statistics(objective.controls)
        self.step = _first_step(objective)
        self.values = {name: float(objective.params[name]) for name in objective.controls}
        self.pending: torch.Tensor | None = None       # [2k] float64: each statistic's local Σ and count
        self.calls = 0
        self._functions = None

    def objective(self) -> Objective:
        """The objective at this step's values (`step` only where the objective reads it)."""
        now = {**self.values, **({STEP: self.step} if STEP in self.base.params else {})}
        return self.base.with_overrides({k: repr(float(v)) if isinstance(v, float) else v for k, v in now.items()},
                                        where=f"{self.base.name} at step {self.step}")

    def observe(self, b, params: dict) -> None:
        """A training call's contribution: each statistic's (Σ, count) over its tokens, in float64
        (`params`: the objective's at this step, which the loss compiled)."""
        if not self.stats:
            return
        if self._functions is None:
            self._functions = [compile_statistic(s, params) for s in self.stats]
        with torch.no_grad():
            b64 = b.detached().widened(torch.float64)
            keep = b64.mask != 0
            b64 = replace(b64.selected(lambda x: torch.where(keep, x, 0.0)), weights=None)
            sums = []
            for fn in self._functions:
                seen: list = []
                fn(replace(b64, pg=lambda t: seen.append(t) or t), keep)
                sums.append(seen[0])
            local = torch.cat(sums)
        self.pending = local if self.pending is None else self.pending + local.to(self.pending.device)
        self.calls += 1

    def end_step(self, process_group=None) -> dict[str, float]:
        """The optimizer step is done: the step's statistics over the ranks, the new values, step + 1."""
        local = self.pending if self.pending is not None else torch.zeros(2 * len(self.stats), dtype=torch.float64)
        totals = torch.cat([local, torch.full((1,), float(self.calls), dtype=torch.float64, device=local.device)])
        if self.stats and _distributed(process_group):
            # NCCL reduces CUDA tensors only; a rank without a training call this step still takes part
            device = "cuda" if torch.distributed.get_backend(process_group) == "nccl" else "cpu"
            totals = totals.to(device)
            torch.distributed.all_reduce(totals, group=process_group)
        values = totals.tolist()
        if self.stats and values[-1] == 0:
            raise RuntimeError(f"openrlhf_drpo: objective '{self.base.name}': end_step() after a step without a "
                               "training call (one with autograd enabled) on any rank: its rules' statistics "
                               "would be of no data; call end_step() once after each optimizer step")
        measured = {s: _statistic(s, values[2 * i], values[2 * i + 1]) for i, s in enumerate(self.stats)}
        params = {**{k: float(v) for k, v in self.base.params.items()}, **self.values, STEP: float(self.step)}
        self.values = next_values(self.base.controls, params, measured) if self.base.controls else {}
        self.step += 1
        self.pending, self.calls, self._functions = None, 0, None
        return self.logged()

    def logged(self) -> dict[str, float]:
        """drpo_<name> for each controlled parameter (its value for the coming step) and drpo_step."""
        return {**{f"drpo_{k}": v for k, v in self.values.items()}, "drpo_step": float(self.step)}

    def state_dict(self) -> dict:
        if self.pending is not None:
            raise RuntimeError(f"openrlhf_drpo: objective '{self.base.name}': its state is saved between "
                               f"optimizer steps, but {self.calls} training call(s) of step {self.step} were not "
                               "ended by end_step(): save after the step's update")
        return {"version": STATE_VERSION, "objective": self.base.name, "step": self.step, "values": dict(self.values)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"openrlhf_drpo: not a controlled objective's state (version {STATE_VERSION}): {state!r}")
        if state.get("objective") != self.base.name:
            raise ValueError(f"openrlhf_drpo: the saved state is objective '{state.get('objective')}'s, not "
                             f"'{self.base.name}'s: resume with the same objective")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step) or step < 0:
            raise ValueError(f"openrlhf_drpo: the saved step {step!r} is not a whole number ≥ 0")
        if set(state["values"]) != set(self.values):
            raise ValueError(f"openrlhf_drpo: the saved state holds {sorted(state['values'])}, but objective "
                             f"'{self.base.name}' controls {sorted(self.values)}: resume with the same objective")
        for name, value in state["values"].items():
            c = self.base.controls[name]
            if not (math.isfinite(value) and c.low <= value <= c.high):
                raise ValueError(f"openrlhf_drpo: the saved value of '{display_name(name)}', {value}, is outside "
                                 f"its bounds [{c.low:g}, {c.high:g}]")
        self.step, self.values = int(state["step"]), {k: float(v) for k, v in state["values"].items()}
        self.pending, self.calls, self._functions = None, 0, None


def reading(objective: Objective) -> Objective:
    """The objective as a host must feed it: its expression and its statistics' arguments (what they
    read: π_ref, H, groups), without the statistics themselves (they are no batch reduction the
    loss call needs whole: end_step sums them)."""
    expr = objective.expr
    for s in statistics(objective.controls):
        expr = Node("add", (expr, s.args[0]))
    return replace(objective, expr=expr)


def compile_statistic(stat: Node, params: dict):
    """One batch statistic as a function of a TokenBatch: its generated code calls `b.pg` once with
    the local [Σ, count] (core.reductions' batch sums), which the caller records."""
    value = select_masks(rewrite_logs(annotate_levels(stat, facts(stat).level)))
    body = function_source("statistic", "a rule's batch statistic; b.pg receives its local [sum, count]", [value], params)
    exec(compile("\n".join(reductions_import(body) + [body]), f"<statistic {stat.op}>", "exec"), namespace := {"torch": torch})
    return namespace["statistic"]


def _first_step(objective: Objective) -> int:
    """The step counter's start: 0, or the `step` a user sets (a whole number, never truncated)."""
    step = objective.params.get(STEP, 0)
    if step != int(step) or step < 0:
        raise ValueError(f"openrlhf_drpo: objective '{objective.name}': step = {float(step):g} is not a whole "
                         "number ≥ 0 (the optimizer step's index)")
    return int(step)


def _statistic(stat: Node, total: float, count: float) -> float:
    return {"batch_sum": total, "batch_count": count, "batch_mean": total / max(count, 1.0)}[stat.op]


def _distributed(group) -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size(group) > 1
