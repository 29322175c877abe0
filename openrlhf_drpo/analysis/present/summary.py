"""The report's first screen, in a researcher's words: what the objective does to a token's
gradient, where the trust region ends for each sign of A, whether w is bounded, and what to
worry about, in at most 100 columns (analysis.present.report puts the evidence after it). Also the
phrases the evidence shares with it."""
from __future__ import annotations

import re
import textwrap

from dsl.library import first_sentence
from dsl.names import canonical_name, display_name
from openrlhf_drpo.analysis.batch.advantage import hatted
from openrlhf_drpo.analysis.present.alert_text import alert_text
from openrlhf_drpo.analysis.present.first_lines import advantage_line, channel_lines
from openrlhf_drpo.analysis.present.memory_text import first_screen as memory_lines
from openrlhf_drpo.analysis.mathtext import fmt, math_text
from openrlhf_drpo.analysis.present.scenario_text import first_screen

WIDTH = 100
SCREEN = 40         # the first screen's lines
GEOMETRY = {
    "none": "w ≡ 1: the plain surrogate, no trust region",
    "ratio": "boundaries are fixed values of r = π/μ (PPO/SPO-like)",
    "binary-tv": "boundaries are fixed values of |π − μ| (DPPO/DRPO-like)",
    "two-level": "w takes two constant values switching at r = 1",
    "advantage-entangled": "a boundary or the weight depends on |A|",
    "other": "none of the named geometries",
}
# what w does at a boundary, as the numeric check saw it
KIND = {"crosses 0": "crosses 0", "jumps across 0": "jumps across 0", "w = 0 beyond": "is 0 beyond it",
        "w = 0 before": "is 0 before it (nearer r = 1)", "unconfirmed": "is unconfirmed there (ℓ is not a finite double)"}
BOUNDED = {True: "bounded", False: "unbounded", None: "not a finite double where sampled"}
_SIGN = {"positive": "A > 0", "negative": "A < 0"}


def kinds(kind: str) -> str:
    return " or ".join(KIND[k] for k in kind.split(", "))


def on_policy(facts) -> str:
    parts = []
    for adv, sign in _SIGN.items():
        f = facts[adv]
        lo, hi = f["w"]
        value = ("undefined" if f["status"] == "undefined" else fmt(lo) if fmt(lo) == fmt(hi)
                 else f"from {fmt(lo)} to {fmt(hi)} (with μ, |A|)")
        parts.append(f"{value} for {sign}")
    return ", ".join(parts)


def weight_range(res) -> str:
    if res.bounded is None:
        return "unknown"
    lo, hi = res.weight_range
    return f"[{'-∞' if lo is None else fmt(lo)}, {'+∞' if hi is None else fmt(hi)}]"


def wrap(text: str, first: str, rest: str | None = None, width: int | None = WIDTH) -> list[str]:
    """`text` after `first`, continued under `rest` (default: aligned with the text), in `width`
    columns (None: one line); a long formula breaks at its operators' spaces (inside a name only
    where it has none)."""
    rest = " " * len(first) if rest is None else rest
    if width is None:
        return [first + text]
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False) \
        or [first.rstrip()]


def written(source: str) -> tuple[str, list[str]]:
    """(the objective line, its bindings' lines) as the file writes them: what a long inlined
    objective abbreviates to."""
    lines = [s.strip() for s in source.splitlines() if s.strip() and not s.strip().startswith(("#", "@"))]
    definitions = [s for s in lines[:-1] if re.match(r"^[^\W\d]\w*\s*=(?!=)", s)]
    return (lines[-1] if lines else ""), definitions


def _objective(res, source: str, width) -> list[str]:
    head = "  objective  "
    if len(head + res.objective) <= (width or WIDTH) or not source:
        return wrap(res.objective + "    (maximized)", head, width=width)
    line, definitions = written(source)
    bindings = [d for d in definitions if canonical_name(d.split("=", 1)[0].strip()) not in res.params]
    out = wrap(line + f"    (maximized; as written{', with its definitions' if bindings else ''})", head, width=width)
    for i, d in enumerate(bindings):
        out += wrap(d, ("    where  " if i == 0 else "           "), "               ", width)
    return out


def _gradient(res, width) -> list[str]:
    head = "  gradient      "
    if res.weight is None:
        out = wrap("∇ℓ = w·r·A·∇log π; w is not derived symbolically (notes below): what follows is measured on "
                   "a grid", head, width=width)
    else:
        formula = res.text["weight"]
        out = wrap(f"∇ℓ = w·r·A·∇log π with w = {formula}", head, width=width)
        if len(wrap(f"∇ℓ = w·r·A·∇log π with w = {formula}", head)) > 3:
            out = wrap(f"∇ℓ = w·r·A·∇log π, w a formula of {len(formula):,} characters ('induced weight' below)", head,
                       width=width)
    both = on_policy(res.on_policy)
    same = re.fullmatch(r"(.+) for A > 0, \1 for A < 0", both)
    both = f"{same.group(1)} for both signs of A" if same else both
    out += wrap(f"on policy (r = 1): w {'' if both.startswith('from') else '= '}{both}; {res.geometry}: {GEOMETRY[res.geometry]}",
                " " * len(head), width=width)
    return out


def _trust_region(res, width) -> list[str]:
    out = []
    for adv, sign in _SIGN.items():
        b, parts = res.boundary[adv], []
        for r_, pi_, kind, ok, met in zip(b["r"], b["pi"], b["kind"], b["reachable"], b["where"]):
            # met at some |A| only (analysis.symbolic.confirm): said where the boundary is, not left to the evidence
            where = f"π = {math_text(pi_)} (r = {math_text(r_)})" + (f",{met[met.index(' at |A| '):]}"
                                                                    if " at |A| " in met else "")
            parts.append(f"at {where}: w {kinds(kind)}" if ok else
                         f"at {where}, unreachable in 0 < π ≤ 1: it never stops an update")
        parts += [f"at {x['where']}, found numerically: w {kinds(x['kind'])}" for x in b["numeric"]]
        if not parts:       # said as firmly as the claim is known
            claim = res.claims["boundary"][adv]
            parts = [f"nowhere: w = 0 everywhere ({claim['status']})" if claim["claim"] == "w ≡ 0" else
                     "nowhere: w never reaches 0, so nothing stops an update" if claim["status"] == "proven" else
                     f"none found: w did not reach 0 where it was checked ({claim['status']})"]
        for i, p in enumerate(parts):
            out += wrap(p, ("  trust region  " if adv == "positive" and i == 0 else " " * 16)
                        + (f"{sign}: " if i == 0 else "        "), " " * 24, width)
    return out


def summary(res, source: str = "", width: int | None = WIDTH) -> list[str]:
    """The first screen; `source` is the objective's text, whose bindings abbreviate a long
    objective; `width` None: unwrapped (what a test reads line by line)."""
    what = " ".join(res.description.split()).partition("Source:")[0].strip()
    title = first_sentence(what) if what else res.name
    params = ", ".join(f"{display_name(k)} = {fmt(v)}" for k, v in res.params.items())
    setting = " · ".join(x for x in (params, f"@anchor = {res.options['anchor']}",
                                     f"@aggregate = {res.options['aggregate']}") if x)
    status = res.claims["bounded"]["status"]
    bounded = {True: f"yes: w ∈ {weight_range(res)} ({status})", None: "unknown: w is not a finite double where sampled",
               False: f"no: w ∈ {weight_range(res)} ({status}): tokens with extreme ratios can dominate the gradient"}
    # (a warning about the host's A itself, a group reduction of it by position, is not about Â)
    hat = hatted if getattr(res, "advantage", None) is not None else (lambda lines: lines)
    worries = [line for a in res.warnings for line in (hat if a.kind != "by position" else list)(
        wrap(alert_text(a), "                ! ", " " * 18, width))]
    worries[:1] = [worries[0].replace(" " * 16, "  worry         ", 1)] if worries else ["  worry         none found"]
    # a claim held at a uniform point says so on the first screen, not only in the evidence
    scope = getattr(res, "scope", None) or {}
    held = ("a uniform batch (each response's tokens share r, μ and A; the other inputs and the reductions as "
            "under 'assumed' below): the claims here hold there only" if scope.get("held") else
            "a response whose tokens share r, μ and A: on other responses a token's gradient also depends on "
            "the rest of the response" if scope.get("sequence") else None)
    held = wrap(held, "  analysed on   ", width=width) if held else []
    # with the objective's own advantage Â, the analysis's A is Â: its lines say so (analysis.batch.advantage)
    own = [x for label, text in advantage_line(res) for x in wrap(text, f"  {label:<14}", width=width)]
    channels = [x for label, text in channel_lines(res) for x in wrap(text, f"  {label:<14}", width=width)]
    # an objective with memory: its controls' rules and bounds, and what moves over them (analysis.memory)
    memory = [x for label, text in memory_lines(getattr(res, "memory", None))
              for x in wrap(text, f"  {label:<14}", width=width)]
    # the file on a line of its own (never wrapped: a path copied from the terminal must work)
    head = [*wrap(f"{res.name} — {title}", "", width=width), f"  {res.path}", *wrap(setting, "  ", width=width),
            *_objective(res, source, width), "", *held, *own, *hat(_gradient(res, width)), *channels,
            *hat(_trust_region(res, width) + wrap(bounded[res.bounded], "  bounded       ", width=width)), *memory]
    room = max(1, min(12, SCREEN - 1 - len(head) - len(worries)))     # the scenarios and a blank fit the 40 lines
    return [*head, *first_screen(getattr(res, "scenarios", None), width, room), *worries]
