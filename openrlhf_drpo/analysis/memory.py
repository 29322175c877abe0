"""An objective with memory (dsl.controls) as the analysis sees it. A controlled parameter is
analysed over its declared bounds: at each bound and at the value analysed above (every combination
of them where there are several); a schedule, an objective that reads `step`, at step 0, at the
step analysed above and at the step where its values stop changing. Each point is the same analysis
at that value (Objective.with_overrides), no new machinery; the claims are compared point by point:
the ones the same at every point, and the ones that change, with their values at each."""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

from dsl.controls import STEP
from dsl.errors import DslError
from dsl.ir import num, postorder, rebuild
from dsl.names import display_name
from dsl.printing import render
from dsl.walks import constant_nodes, evaluate
from openrlhf_drpo.analysis.mathtext import fmt, math_text
from openrlhf_drpo.analysis.present.alert_text import alert_text

POINTS = 9              # the bounds' combinations analysed at most; past that, each parameter alone
LATEST = 10 ** 7        # a schedule is followed up to this step
_SIGN = {"positive": "A > 0", "negative": "A < 0"}


def reads_step(obj) -> bool:
    return any(m.op == "param" and m.value == STEP for m in obj.expr.walk())


def has_memory(obj) -> bool:
    return bool(obj.controls) or reads_step(obj)


def memory(obj, base, w_reads: set, analyse) -> dict | None:
    """None without memory; else the controls and the schedule, each with its rows (one per point
    analysed: its values and claims), the claims the same at every row and those that change.
    `base` is the analysis at obj's values, `w_reads` the parameters ∂ℓ/∂r of w's terms reads,
    analyse(objective) the same analysis at another objective (without its own memory)."""
    if not has_memory(obj):
        return None
    controls = [{"name": c.name, "shown": display_name(c.name), "rule": c.text(), "written": written_rule(obj, c),
                 "low": c.low, "high": c.high, "value": float(obj.params[c.name]), "w_reads": c.name in w_reads}
                for c in obj.controls.values()]
    out = {"controls": controls, "bounds": None, "schedule": None,
           "against": None if base.advantage is None else "Â"}
    if controls:
        # one parameter that w reads: the midpoints too, for how the claims move between the bounds
        dense = len(controls) == 1 and controls[0]["w_reads"]
        out["bounds"] = {**_compare([_row(obj, base, analyse, values) for values in box(obj, dense)]), "dense": dense}
    if reads_step(obj):
        out["schedule"] = schedule(obj, base, analyse)
    return out


def written_rule(obj, c) -> str:
    """The update line as the file writes it (its bindings by name), else as the IR renders it."""
    lines = obj.source.split("\n")
    line = lines[c.pos.line - 1].split("#")[0].strip() if 0 < c.pos.line <= len(lines) else ""
    return line or c.text()


def box(obj, dense: bool = False) -> list[dict]:
    """The controlled values analysed: each parameter's bounds and its value here (`dense`: and the
    midpoints between them), every combination up to POINTS of them, else each parameter alone (the
    others at their values here)."""
    here = {k: Fraction(obj.params[k]) for k in obj.controls}
    axes = {k: sorted({_exact(c.low), here[k], _exact(c.high)}) for k, c in obj.controls.items()}
    if dense:
        axes = {k: sorted({*vs, *((a + b) / 2 for a, b in zip(vs, vs[1:]))}) for k, vs in axes.items()}
    if math.prod(map(len, axes.values())) <= POINTS:
        return [dict(zip(axes, v)) for v in itertools.product(*axes.values())]
    return [here] + [{**here, k: v} for k, vs in axes.items() for v in vs if v != here[k]]


def schedule(obj, base, analyse) -> dict:
    """The schedule: its values (the step-dependent definitions) and the analysis at step 0, at the
    step analysed above and where its values stop changing (None where they still change at LATEST)."""
    now = int(obj.params[STEP])
    settled = settles(obj)
    steps = sorted({0, now} | ({settled} if settled is not None else set()))
    rows = [_row(obj, base, analyse, {STEP: Fraction(s)}) for s in steps]
    for row in rows:
        row["role"] = ", ".join(x for x in ("the first step" * (row["values"][STEP] == 0),
                                            "settled" * (row["values"][STEP] == settled and settled != 0)) if x) or None
    parts = schedule_parts(obj)
    values = [{"name": name, "at": [[s, _value(node, obj, s)] for s in steps]} for name, node in parts]
    return {**_compare(rows), "step": now, "settles": settled, "latest": LATEST, "values": values}


def schedule_parts(obj) -> list[tuple[str, object]]:
    """The step-dependent values the objective reads: its definitions of parameters and `step` only
    (ε = 0.1·max(1 - step/total, 0)) by name, else the largest such sub-expressions as written."""
    constant = constant_nodes(obj.expr)
    reads = {n for n in constant if any(m.op == "param" and m.value == STEP for m in n.walk())}
    named = [(display_name(k), n) for k, n in obj.bindings.items() if n in reads]
    if named:
        return named
    inside = {a for n in reads for a in n.args}
    return [(render(n), n) for n in dict.fromkeys(postorder(obj.expr)) if n in reads and n not in inside]


def settles(obj) -> int | None:
    """The first step from which the schedule's values are those at LATEST: found on a 1-2-5 grid of
    steps, then by bisection between the two grid steps around it; None where they still change
    between the grid's last two steps; 0 where they never change."""
    nodes = [n for _, n in schedule_parts(obj)]
    at = lambda s: tuple(_key(_value(n, obj, s)) for n in nodes)  # noqa: E731
    grid = [0] + [m * 10 ** k for k in range(8) for m in (1, 2, 5) if m * 10 ** k <= LATEST]
    values = [at(s) for s in grid]
    last = values[-1]
    if values[-2] != last:
        return None
    i = len(grid) - 1
    while i > 0 and values[i - 1] == last:
        i -= 1
    if i == 0:
        return 0
    lo, hi = grid[i - 1], grid[i]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if at(mid) == last else (mid, hi)
    return hi


def _value(node, obj, step) -> float:
    env = {k: float(v) for k, v in obj.params.items()}
    env[STEP] = float(step)
    try:
        return evaluate(node, env)
    except (ValueError, ZeroDivisionError, OverflowError):
        return math.nan


def _exact(x: float) -> Fraction:
    """A bound as written (0.1 is 1/10, not the double nearest it): its shortest decimal."""
    return Fraction(repr(float(x)))


def _key(x):
    return "nan" if isinstance(x, float) and math.isnan(x) else x


def _row(obj, base, analyse, values: dict) -> dict:
    """One point: its values, whether it is the analysis above, and its claims (or why none)."""
    above = all(Fraction(obj.params[k]) == v for k, v in values.items())
    at = ", ".join(f"{display_name(k)} = {fmt(float(v))}" for k, v in values.items())
    row = {"values": {k: float(v) for k, v in values.items()}, "at": at, "above": above, "role": _role(obj, values),
           "claims": None, "error": None}
    try:
        res = base if above else analyse(obj.with_overrides({k: str(v) for k, v in values.items()}, where="bounds"))
    except (DslError, ValueError) as e:     # e.g. a 1/δ at δ's bound 0: said at that point, never skipped
        row["error"] = (e.message if isinstance(e, DslError) else str(e)).splitlines()[0]
        return row
    row["claims"] = claims(res)
    return row


def _role(obj, values) -> str | None:
    """Which bound a single controlled parameter's value is (with several, the values say it)."""
    c = obj.controls.get(next(iter(values))) if len(values) == 1 else None
    if c is None or values[c.name] not in (_exact(c.low), _exact(c.high)):
        return None
    return "lower bound" if values[c.name] == _exact(c.low) else "upper bound"


CLAIMS = ("advantage", "w", "range", "trust region A > 0", "trust region A < 0", "smooth", "geometry", "w at r = 1",
          "entropy channel", "reference channel", "warnings")


def claims(res) -> dict:
    """The claims a point is compared on, each as the report words it."""
    out = {"w": res.text["weight"] or "not derived", "range": _range(res)}
    if res.advantage is not None:       # w is against the objective's own Â, which may read the parameter
        value = (res.advantage["held"] or {}).get("value")
        out["advantage"] = "Â = " + (math_text(value) if value is not None else
                                     f"{res.advantage['expression']} (no value here)")
    for adv, sign in _SIGN.items():
        b = res.boundary[adv]
        parts = [f"r = {math_text(r)}" + ("" if ok else " (unreachable)") for r, ok in zip(b["r"], b["reachable"])]
        parts += [f"{x['where']} (numeric)" for x in b["numeric"]]
        out[f"trust region {sign}"] = ", ".join(parts) or "none"
    out["smooth"] = "yes" if res.smooth else "no"
    out["geometry"] = res.geometry
    out["w at r = 1"] = "; ".join(f"{_span(f['w']) if f['status'] != 'undefined' else 'undefined'} for {_SIGN[adv]}"
                                  for adv, f in res.on_policy.items())
    values = {k: v for k, v in res.params.items()}
    if res.entropy is not None:
        w_h = res.entropy["w_H"]
        out["entropy channel"] = "w_H not derived" if w_h is None else f"w_H = {_at(w_h, values)}"
    if res.reference is not None:
        grad = res.reference["grad"]
        out["reference channel"] = ("∂ℓ_ref/∂log π not derived" if grad is None else
                                    f"∂ℓ_ref/∂log π = {_at(grad, values, weight=True)}")
    out["warnings"] = "; ".join(alert_text(a) for a in res.warnings) or "none"
    return out


def _range(res) -> str:
    if res.bounded is None:
        return "w unknown (not a finite double where sampled)"
    lo, hi = res.weight_range
    return f"w ∈ [{'-∞' if lo is None else fmt(lo)}, {'+∞' if hi is None else fmt(hi)}]"


def _span(w) -> str:
    lo, hi = w
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} to {fmt(hi)}"


def _at(e, values, weight=False) -> str:
    """A channel's formula at the point's parameter values (it keeps them as symbols)."""
    import sympy as sp
    e = e.subs({s: sp.nsimplify(values[s.name]) for s in e.free_symbols if s.name in values})
    return math_text(e, weight=weight)


def _compare(rows: list[dict]) -> dict:
    """The rows, the claims the same at every analysed row and those that change."""
    done = [r for r in rows if r["claims"] is not None]
    keys = [k for k in CLAIMS if done and k in done[0]["claims"]]
    same = [k for k in keys if len({r["claims"][k] for r in done}) == 1]
    return {"rows": rows, "same": same, "changes": [k for k in keys if k not in same],
            "errors": [r["at"] for r in rows if r["error"]]}


def equiv_points(a, b) -> list[dict]:
    """--equiv between objectives with memory: the values both are compared at (their controls'
    bounds and values, then the step given, step 0 and where either's schedule settles); [{}]
    without. Two whose controllers differ are refused by name, at the first update line that
    differs: after the first step their parameters move apart, which one step's gradients do not
    settle."""
    if not has_memory(a) and not has_memory(b):
        return [{}]
    said = lambda o: {c.name: (_rule(o, c), c.low, c.high, o.params[c.name]) for c in o.controls.values()}  # noqa: E731
    if said(a) != said(b):
        o = next(o for o in (a, b) for k in o.controls if said(a).get(k) != said(b).get(k))
        c = next(c for c in o.controls.values() if said(a).get(c.name) != said(b).get(c.name))
        other = b if o is a else a
        theirs = other.controls.get(c.name)
        line = o.source.split("\n")[c.pos.line - 1] if 0 < c.pos.line <= o.source.count("\n") + 1 else None
        shown = lambda x, y: (f"{display_name(c.name)} ← {_rule(x, y)} in [{fmt(y.low)}, {fmt(y.high)}], "  # noqa: E731
                              f"from {fmt(float(x.params[c.name]))}")
        raise DslError(f"--equiv: {o.name} updates {display_name(c.name)} after each step ({shown(o, c)}) and "
                       + (f"{other.name} by another rule, bounds or first value ({shown(other, theirs)})" if theirs
                          else f"{other.name} does not"),
                       o.path, c.pos.line, c.pos.col, line,
                       "--equiv compares objectives with memory whose controllers are the same: after the first "
                       "step their parameters would move apart, which comparing one step's gradients does not settle")
    points = box(a) if a.controls else []
    if reads_step(a) or reads_step(b):
        now = Fraction(a.params.get(STEP, b.params.get(STEP, 0)))
        settled = {s for o in (a, b) if reads_step(o) and (s := settles(o)) is not None}
        points = (points or [{STEP: now}]) + [{STEP: Fraction(s)} for s in sorted({0} | settled) if s != now]
    return points


def _rule(obj, c) -> str:
    """A rule with its fixed parameters' values (two files may name different targets alike)."""
    fixed = lambda m, args: num(obj.params[m.value]) if m.op == "param" and m.value not in obj.controls \
        and m.value != STEP else None  # noqa: E731
    return render(rebuild(c.rule, fixed))
