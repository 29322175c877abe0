"""An objective with memory in words (analysis.memory): the first screen's lines (its controls'
rules and bounds, what holds at every value analysed and what moves; its schedule at the steps
analysed) and the evidence's rows, one per point analysed."""
from __future__ import annotations

import math

from openrlhf_drpo.analysis.mathtext import fmt

_WORDS = {"advantage": "the advantage Â", "w": "w", "range": "the range of w",
          "trust region A > 0": "the trust region for A > 0", "trust region A < 0": "the trust region for A < 0", "smooth": "smoothness", "geometry": "the geometry",
          "w at r = 1": "w at r = 1", "entropy channel": "the entropy channel", "reference channel":
          "the reference channel", "warnings": "the worries"}
SHORT = 48      # characters of a claim the first screen prints; longer, the evidence's rows do
_SHOWN = ("range", "trust region A > 0", "trust region A < 0")      # on every row, changed or not


def _step(s) -> str:
    return f"{int(s):,}" if s >= 10000 else f"{int(s)}"


def _listed(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _same(part: dict) -> str:
    """What holds at every point, with the range's and the trust region's values."""
    done = [r for r in part["rows"] if r["claims"]]
    if not done:
        return ""
    c, same = done[0]["claims"], part["same"]
    said = [c["range"]] if "range" in same else []
    both = [k for k in ("trust region A > 0", "trust region A < 0") if k in same]
    if both:
        sides = "; ".join(f"{k[-5:]}: {c[k]}" for k in both)
        said.append(f"the trust region ({sides})")
    return f"{_listed(said)} at each" if said else ""


def _changes(part: dict) -> list[str]:
    """Each claim that changes, from the first point analysed to the last."""
    done = [r for r in part["rows"] if r["claims"]]
    out = []
    for k in part["changes"]:
        if k == "w" and len(part["changes"]) > 1:        # what moves says how w changes
            continue
        first, last = done[0], done[-1]
        a, b = first["claims"][k], last["claims"][k]
        if len(a) > SHORT or len(b) > SHORT:     # a long formula: the rows below print it whole
            out.append(f"{_WORDS[k]} changes from {first['at']} to {last['at']} (its value at each: evidence below)")
        elif k == "warnings":
            out.append("the worries change (evidence below)")
        elif a == b:
            out.append(f"{_WORDS[k]} changes between {first['at']} and {last['at']} (evidence below)")
        elif k == "w":
            out.append("w changes, its range and trust region do not (evidence below)")
        else:
            out.append(f"{_WORDS[k]} moves from {a} at {first['at']} to {b} at {last['at']}")
    out += [f"not analysable at {at} (evidence below)" for at in part["errors"]]
    return out


def first_screen(mem: dict | None) -> list[tuple[str, str]]:
    """(label, text): the controls' line and the schedule's, where the objective has them."""
    if not mem:
        return []
    out = []
    if mem["bounds"]:
        part, controls = mem["bounds"], mem["controls"]
        free = [c["shown"] for c in controls if not c["w_reads"]]
        values = f"{controls[0]['shown']} = " + _listed([fmt(r["values"][controls[0]["name"]]) for r in part["rows"]]) \
            if len(controls) == 1 else _points(part, controls)
        same = _same(part)
        if same and free and len(free) == len(controls):
            same += f", as w does not read {_listed(free)}"
        text = (f"{'; '.join(c['written'] for c in controls)}, after each optimizer step. At {values}: "
                + "; ".join(x for x in [*_changes(part), same] if x))
        out.append(("memory", text))
    if mem["schedule"]:
        out.append(("schedule", _schedule_head(mem["schedule"]) + "".join(
            f"; {x}" for x in _changes(mem["schedule"])) + "; --set step=N analyses step N"))
    return out


def _points(part: dict, controls: list) -> str:
    """Several controlled parameters: every combination of their values, or each alone."""
    axes = [len({r["values"][c["name"]] for r in part["rows"]}) for c in controls]
    if len(part["rows"]) == math.prod(axes):
        return f"{len(part['rows'])} combinations of their bounds and first values"
    return "each one's bounds, the others at their first values"


def _schedule_head(sc: dict) -> str:
    steps = [r["values"]["step"] for r in sc["rows"]]
    values = "; ".join(f"{v['name']} = " + ", ".join(f"{fmt(x)} at step {_step(s)}" for s, x in v["at"])
                       for v in sc["values"])
    if sc["settles"] is None:
        when = f"its values still change at step {_step(sc['latest'])}"
    elif sc["settles"] == 0:
        when = f"its values are the same at every step to {_step(sc['latest'])}"
    else:
        when = f"they stop changing at step {_step(sc['settles'])}"
    return (f"reads step, the optimizer step's index: analysed above at step {_step(sc['step'])}, here also at "
            f"step {_listed([_step(s) for s in steps if s != sc['step']]) if len(steps) > 1 else 'no other'} "
            f"({values}{'; ' if values else ''}{when})")


def evidence(mem: dict) -> list[str]:
    """The controls' rules, bounds and rows; the schedule's; each with what holds and what moves."""
    out = []
    if mem["bounds"]:
        controls, part = mem["controls"], mem["bounds"]
        rules = "; ".join(c["rule"] for c in controls)
        out += ["", f"  memory     {rules}: set after each optimizer step from that step's batch (the step's loss "
                    "reads the value from before it), the analysis repeated at each bound and at the value above"
                    + " and the midpoints between them" * part["dense"]]
        out += _rows(part, "the controlled values")
        for c in controls:
            span = f"[{fmt(c['low'])}, {fmt(c['high'])}]"
            against = f" (against {mem['against']})" if mem["against"] else ""
            out.append(f"    w{against} does not read {c['shown']} (∂ℓ/∂r of w's terms has no {c['shown']}): what the "
                       f"report says of w holds for every {c['shown']} in {span}" if not c["w_reads"] else
                       f"    w reads {c['shown']}: between these values nothing is analysed (--set "
                       f"{c['name']}=X analyses X in {span})")
    if mem["schedule"]:
        sc = mem["schedule"]
        out += ["", f"  schedule   {_schedule_head(sc)}: found on a 1-2-5 grid of steps to {_step(sc['latest'])}, then "
                    "by bisection; --set step=N analyses step N"]
        out += _rows(sc, "the step")
    return out


def _rows(part: dict, what: str) -> list[str]:
    labels = [r["at"] + (f" ({r['role']}{', above' if r['above'] else ''})" if r["role"] else
                         " (above)" if r["above"] else "") for r in part["rows"]]
    width = max(map(len, labels))
    out = []
    for label, r in zip(labels, part["rows"]):
        if r["error"]:
            out.append(f"    {label:<{width}}   not analysable: {r['error']}")
            continue
        c = r["claims"]
        cells = [c["range"], *(f"{k[-5:]}: {c[k]}" for k in _SHOWN[1:])]
        cells += [c[k] for k in part["changes"] if k not in _SHOWN and k not in ("w", "warnings")]
        if "warnings" in part["changes"]:
            cells.append("no worry" if c["warnings"] == "none" else f"{len(c['warnings'].split('; '))} worry(ies)")
        out.append(f"    {label:<{width}}   " + "; ".join(x for x in cells if x))
    same = [_WORDS[k] for k in part["same"]]
    out.append(f"    the same at each: {_listed(same)}" if same else "    nothing is the same at each")
    if part["changes"]:
        out.append(f"    changes with {what}: {_listed([_WORDS[k] for k in part['changes']])}")
    return out
