"""The language's fifth version: objectives with memory. `step` is the optimizer step's index (0 at
the first step, the same on every rank). A controlled parameter is a parameter whose value after
each optimizer step is its rule's, clamped into its bounds:

    β = 0.05                                                       # its value at the first step
    β ← β·(1 + clip(batch_mean(log(π) - log(π_ref))/6 - 1, -0.2, 0.2)·512/10000) in [0.001, 10]

A rule reads numbers, parameters (the controlled ones at their values during the step), `step` and
batch statistics: batch_sum, batch_mean or batch_count of a per-token or per-response value, taken
over the step's whole batch on every rank, with no gradient. Each is a sum, so a host accumulates it
exactly over micro-batches (openrlhf_drpo.core.controls). Everything here is checked where it is
written, and the update itself (`next_values`) is plain float64 arithmetic, the same on every rank."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction

from dsl.ir import Node, Pos, num, rebuild
from dsl.names import display_name
from dsl.operations import OPS
from dsl.printing import render
from dsl.walks import evaluate

STEP = "step"
STEP_MEANING = "the optimizer step's index, 0 at the first step and the same on every rank"
# the batch statistics a rule may read: sums, so that micro-batches and ranks add up exactly
STATISTICS = ("batch_sum", "batch_mean", "batch_count")


@dataclass(frozen=True)
class Control:
    """One controlled parameter: its update rule and bounds (its value is the objective's parameter)."""
    name: str
    rule: Node
    low: float
    high: float
    pos: Pos = field(compare=False)      # the update line's name, for errors raised during training
    bounds: tuple = field(default=(), compare=False, repr=False)     # as written: a bound may be a parameter

    def text(self) -> str:
        return f"{display_name(self.name)} ← {render(self.rule)} in [{_g(self.low)}, {_g(self.high)}]"


def statistics(controls: dict) -> list[Node]:
    """The distinct batch statistics the rules read, in a fixed order (their first appearance)."""
    out: list[Node] = []
    for c in controls.values():
        for n in c.rule.walk():
            if n.op in STATISTICS and n not in out:
                out.append(n)
    return out


def check_rule(src, name: str, rule: Node, bounds: tuple | None, params: dict, pos: Pos,
               controlled=()) -> Control:
    """The update line `name ← rule in [low, high]` as a Control, or a located error: no bounds, bounds
    that are not finite constants with low < high around the first step's value, a value that depends
    on the position (a token's or a response's value outside a batch statistic), a statistic that is
    not a sum (an order statistic is not exact over micro-batches) or nests another, a constant divisor
    that is not positive (a controller's target or horizon)."""
    shown = display_name(name)
    if bounds is None:
        raise src.error(f"the controlled parameter '{shown}' has no bounds", _end(src, pos),
                        f"end the line with its range, e.g. '{shown} ← ... in [0, 1]': its value is clamped into it")
    low, high = (_constant_bound(src, b, params, controlled) for b in bounds)
    if not low < high:
        raise src.error(f"the bounds of '{shown}', [{_g(low)}, {_g(high)}], are empty or a single point", bounds[0].pos or pos,
                        "write [low, high] with low < high")
    if not low <= float(params[name]) <= high:
        raise src.error(f"the value of '{shown}' at the first step, {_g(float(params[name]))}, is outside its bounds "
                        f"[{_g(low)}, {_g(high)}]", pos, f"set {shown} = ... to a value in [{_g(low)}, {_g(high)}]")
    _check_reads(src, rule, pos)
    for divisor, value in _divisors(rule, params, controlled):
        if not value > 0:
            raise src.error(f"the rule of '{shown}' divides by '{render(divisor)}' = {_g(value)}, which is not "
                            "positive", divisor.pos or pos, DIVISOR_HINT)
    return Control(name, rule, low, high, pos, tuple(bounds))


DIVISOR_HINT = "a controller's target and horizon are positive (the update would diverge or divide by zero)"


def at_values(controls: dict, params: dict) -> dict:
    """The controls at other parameter values (an override): bounds that read a parameter evaluated
    again, the checks of check_rule repeated; ValueError(message, the parameters it reads, the Control) where one
    fails, so that an override cannot undo what the file was refused for."""
    values, out = {k: float(v) for k, v in params.items()}, {}
    for name, c in controls.items():
        shown = display_name(name)
        for divisor, value in _divisors(c.rule, params, controls):
            if not value > 0:
                raise ValueError(f"the rule of '{shown}' divides by '{render(divisor)}' = {_g(value)}, which is not "
                                 f"positive ({DIVISOR_HINT})", _reads(divisor), c)
        low, high = (_value(b, values) for b in c.bounds) if c.bounds else (c.low, c.high)
        read = {n for b in c.bounds for n in _reads(b)} | {name}
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"the bounds of '{shown}', [{_g(low)}, {_g(high)}], are not finite with low < high", read, c)
        if not low <= values[name] <= high:
            raise ValueError(f"'{shown}' = {_g(values[name])} is outside its bounds [{_g(low)}, {_g(high)}]", read, c)
        out[name] = replace(c, low=low, high=high)
    return out


def _divisors(rule: Node, params: dict, controlled):
    """Each constant divisor of a rule (a target, a horizon) with its value at `params`."""
    for n in rule.walk():
        if n.op == "div" and _constant(n.args[1], controlled):
            yield n.args[1], _value(n.args[1], {k: float(v) for k, v in params.items()})


def _value(n: Node, values: dict) -> float:
    try:
        return evaluate(n, values)
    except (ValueError, ZeroDivisionError, OverflowError):
        return math.nan


def _reads(n: Node) -> set:
    return {m.value for m in n.walk() if m.op == "param"}


def next_values(controls: dict, params: dict, stats: dict) -> dict[str, float]:
    """Each controlled parameter's value for the next step: its rule at the finished step's parameter
    values (`params`: name -> float, `step` among them) and statistics (`stats`: Node -> float),
    clamped into its bounds. All rules read the values from before the update. A rule that is not a
    finite number (a NaN statistic, a log of 0) raises ValueError naming it: never clamped, never kept."""
    frozen = lambda n, args: num(Fraction(stats[n])) if n in stats and math.isfinite(stats[n]) else None  # noqa: E731
    out = {}
    for name, c in controls.items():
        rule = rebuild(c.rule, frozen)
        try:
            value = evaluate(rule, params) if not any(n in stats and not math.isfinite(stats[n]) for n in c.rule.walk()) \
                else math.nan
        except (ValueError, ZeroDivisionError, OverflowError):
            value = math.nan
        if not math.isfinite(value):
            seen = ", ".join(f"{render(n)} = {stats[n]:.6g}" for n in statistics({name: c}))
            raise ValueError(f"controlled parameter '{display_name(name)}' (line {c.pos.line}): its rule "
                             f"{render(c.rule)} is {value} after step {int(params.get(STEP, 0))}"
                             f"{' at ' + seen if seen else ''}; its value is not updated to a number that is not one")
        out[name] = min(max(value, c.low), c.high)
    return out


def _check_reads(src, rule: Node, pos: Pos) -> None:
    """Outside a batch statistic a rule reads numbers, parameters and `step` only."""
    stack = [rule]
    while stack:
        n = stack.pop()
        if n.op in STATISTICS:
            inner = next((m for m in n.args[0].walk() if m.op in OPS and OPS[m.op].over == "batch"), None)
            if inner is not None:
                raise src.error(f"the statistic '{render(n)}' reads another batch reduction, '{render(inner)}'",
                                inner.pos or n.pos or pos, "a rule's statistic is one batch_sum, batch_mean or "
                                "batch_count of a token's or a response's value (each a sum over micro-batches)")
            continue
        if n.op in OPS and OPS[n.op].over == "batch":
            raise src.error(f"'{n.op}' in an update rule: an order statistic is not exact over the micro-batches "
                            "and ranks of a step", n.pos or pos, f"a rule reads {', '.join(STATISTICS)}")
        if n.op == "var" or (n.op in OPS and OPS[n.op].reduce):
            raise src.error(f"the update rule depends on the position: '{render(n)}' is one value per "
                            f"{'token' if n.op == 'var' else 'response or group'}", n.pos or pos,
                            f"a rule is the same for every token: take a batch statistic of it, e.g. "
                            f"batch_mean({render(n)})")
        stack.extend(n.args)


def _constant(n: Node, controlled) -> bool:
    """Numbers and fixed parameters only: the same at every step (no statistic, no `step`, no
    controlled parameter)."""
    return all(m.op == "num" or (m.op == "param" and m.value != STEP and m.value not in controlled) or
               (m.op in OPS and not OPS[m.op].reduce) for m in n.walk()) and not any(m.op == "var" for m in n.walk())


def _constant_bound(src, n: Node, params: dict, controlled=()) -> float:
    # a controlled parameter moves at every step: a bound that read one would move with it
    if any(m.op == "var" or (m.op in OPS and OPS[m.op].reduce) or (m.op == "param" and (m.value == STEP or
                                                                                      m.value in controlled))
           for m in n.walk()):
        raise src.error(f"a bound must be a constant, got '{render(n)}'", n.pos,
                        "write a number or a parameter that no rule updates")
    try:
        value = evaluate(n, {k: float(v) for k, v in params.items()})
    except (ValueError, ZeroDivisionError, OverflowError):
        value = math.nan
    if not math.isfinite(value):
        raise src.error(f"the bound '{render(n)}' is not a finite number", n.pos, "write a finite number")
    return value


def _end(src, pos: Pos) -> Pos:
    # after the rule, not after a comment that ends the line
    return Pos(pos.line, len(src.lines[pos.line - 1].split("#")[0].rstrip()) + 1)


def _g(x: float) -> str:
    return f"{x:g}"

