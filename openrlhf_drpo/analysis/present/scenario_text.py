"""The scenarios in words (analysis.batch.scenarios): one first-screen line per scenario that changes
the gradient and per indicator constant on every scenario, the evidence's full list, and
drpo-analyze --scenarios' listing."""
from __future__ import annotations

import json
import textwrap

WIDTH = 100
HEAD = "  scenarios     "
_CHECK = {"agrees": "the compiled loss agrees", "disagrees": "the compiled loss DISAGREES",
          "not checked": "not checked against the compiled loss", "not run": "the compiled loss's check not run"}


def _wrap(text, first, rest, width):
    if width is None:
        return [first + text]
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def _constant(ind, named=True) -> str:
    if ind["state"].endswith("held point only"):
        return (f"{ind['indicator'] + ' ' if named else ''}is {1 if ind['state'].startswith('always') else 0} at every "
                "point sampled, at the held point only: it reads a held value (ρ, π_ref, H, Σπ²) or a statistic "
                "that ties with its value on the uniform batch; elsewhere it may switch (not analysed)")
    where = ("on every scenario at every point sampled (|A| from 0.001 to 1000; the scenarios' groups, |y| and "
             "staleness)")
    return (f"{ind['indicator'] + ' ' if named else ''}is 1 {where}: always on" if ind["state"] == "always on"
            else f"{ind['indicator'] + ' ' if named else ''}is 0 {where}: dead, no gradient passes it")


def first_screen(sc: dict | None, width: int | None = WIDTH, room: int = 12) -> list[str]:
    """The scenarios that change the gradient, each on its line, with the check's word where it
    disagrees; the indicators constant on every scenario; how many others are as analysed; within
    `room` lines (the screen's 40), the rest named on the last."""
    if not sc:
        return []
    changed = [s for s in sc["scenarios"] if s["changes"]]
    lines = [f"{s['title']}: {s['text']}" + (" (the compiled loss DISAGREES: evidence below)"
                                            if s["loss_check"]["status"] == "disagrees" else "") for s in changed]
    lines += [_constant(i).replace(" (|A| from 0.001 to 1000; the scenarios' groups, |y| and staleness)", "")
              for i in sc["indicators"] if i["state"] in ("always on", "dead")]
    same = len(sc["scenarios"]) - len(changed)
    if same and changed:
        lines.append(f"{same} other{'s' if same > 1 else ''} as analysed (--scenarios lists them)")
    elif same:
        lines.append(f"{same} scenario{'s' if same > 1 else ''} ({', '.join(s['name'] for s in sc['scenarios'])}): "
                     "each as analysed (--scenarios lists them)")
    indent = " " * (len(HEAD) + 2)
    blocks = [_wrap(text, HEAD if i == 0 else " " * len(HEAD), indent, width) for i, text in enumerate(lines)]
    if sum(map(len, blocks)) <= room:
        return [x for b in blocks for x in b]
    out = []
    for i, block in enumerate(blocks[:len(changed)]):
        if len(out) + len(block) > room - 2:
            rest = [s["name"] for s in changed[i:]]
            text = (f"{'and ' if out else ''}{len(rest)} {'more ' if out else ''}that change the gradient "
                    f"({', '.join(rest)}): --scenarios lists them")
            return out + (_wrap(text, HEAD if not out else " " * len(HEAD), indent, width)
                          if room - len(out) >= 2 else [f"{HEAD}{len(rest)} change the gradient: --scenarios"])
        out += block
    return out + ([f"{HEAD if not out else ' ' * len(HEAD)}and more: --scenarios lists them"] if len(out) < room else [])


def _point(p: dict) -> str:
    parts = []
    if "group" in p:
        parts.append(f"the group's advantages A·({', '.join(f'{c:g}' for c in p['group'])})")
    if "seq_len" in p and p["seq_len"] != 1 or "position" in p and p.get("position", 1) != p.get("seq_len", 1):
        parts.append(f"|y| = {p.get('seq_len', 1)}" + (f", position {p['position']}" if "position" in p else ""))
    parts += [f"{k} = {v:g}" for k, v in p.get("held", {}).items()]
    return "; ".join(parts) or "the analysed point"


def _check(c: dict) -> str:
    if c["status"] == "agrees":
        return f"the compiled loss agrees (float64 autograd, {c['points']} points)"
    if c["status"] == "disagrees":
        x = c["where"]
        return (f"the compiled loss DISAGREES: at r = {x['r']:g}, μ = {x['mu']:g}, A = {x['A']:g} its token's weight is "
                f"{x['loss']} against the analysis's {x['analysis']}")
    return f"{_CHECK[c['status']]}: {c['why']}"


def json_key(x) -> str:
    return json.dumps(x, sort_keys=True)


def evidence(sc: dict | None) -> list[str]:
    """The evidence's list: every scenario, its held point, its claim and the compiled loss's word."""
    if not sc:
        return []
    s0 = sc["sampled"]
    checks = {json_key(s["loss_check"]) for s in sc["scenarios"]}
    once = len(checks) == 1 and sc["scenarios"][0]["loss_check"]["status"] == "not run"
    out = [f"  scenarios  derived from the objective's constructs; w = (∂ℓ/∂r)/A at each against the analysed "
           f"point, and each indicator, by the IR's float rules at {s0['points']:,} points (numeric: r from "
           f"{s0['r'][0]:g} to {s0['r'][1]:g} with π ≤ 1, μ from {s0['mu'][0]:g} to {s0['mu'][1]:g}, |A| from "
           f"{s0['magnitudes'][0]:g} to {s0['magnitudes'][1]:g}, both signs)"
           + (f"; {_check(sc['scenarios'][0]['loss_check'])}" if once else "")]
    for s in sc["scenarios"]:
        out.append(f"    {s['name']:<14} {s['title']} ({_point(s['point'])}): {s['text']}"
                   + ("" if once else f"; {_check(s['loss_check'])}"))
    for i in sc["indicators"]:
        out.append(f"    indicator      {i['indicator']}: " + (
            "reads the token's r, π, μ or A: where it switches is the trust region's (above)"
            if i["state"] == "with the token" else "0 on some scenarios or points, 1 on others"
            if i["state"] == "switches" else _constant(i, False)))
    return out


def listing(name: str, sc: dict | None) -> str:
    """drpo-analyze --scenarios: each scenario's name and words, one a line."""
    if not sc or not sc["scenarios"]:
        return (f"{name}: no scenarios (it reads no group, batch, response, prefix, turn or staleness construct); "
                "the analysis is per token")
    width = max(len(s["name"]) for s in sc["scenarios"])
    return "\n".join([f"{name}: {len(sc['scenarios'])} scenarios (--scenario NAME analyses one)"]
                     + [f"  {s['name']:<{width}}  {s['title']}: {s['text']}" for s in sc["scenarios"]])
