"""Human-readable output of an analysis: the report (each declared field's line, analysis.result),
the JSON form, the comparison table, the plot, and the equivalence report."""
from __future__ import annotations

import re
from dataclasses import fields

from openrlhf_drpo.analysis.present.alert_text import alert_text
from openrlhf_drpo.analysis.mathtext import clip_text, fmt, magnitudes, math_text
from dsl.names import display_name
from openrlhf_drpo.analysis.result import Analysis
from openrlhf_drpo.analysis.present.memory_text import evidence as memory_evidence
from openrlhf_drpo.analysis.present.scenario_text import evidence as scenario_evidence
from openrlhf_drpo.analysis.present.summary import BOUNDED, GEOMETRY, WIDTH, kinds, on_policy, summary, weight_range, wrap

def _status(claim) -> str:
    """How a claim is known (analysis.claims): proven, found at located points, or
    unconfirmed, with the evidence it rests on."""
    return f"{claim['status']}: {claim['evidence']}"


# ------------------------------------------------------------------ the report, line by line
# Each declared field's report line (analysis.result's `line`), in the order the report prints them:
# render(result, evidence) -> lines, where evidence is the claim the field declares it rests on.
LINES: dict = {}


def line(name):
    def register(render):
        LINES[name] = render
        return render
    return register


@line("title")
def _title(res, evidence):
    title = res.description.splitlines()[0] if res.description else res.name
    return [f"{res.name} — {title}", f"  file       {res.path}"]


@line("objective")
def _objective(res, evidence):
    if len(res.objective) > 4 * WIDTH:     # its bindings, as written, are in the summary
        return [f"  objective  inlined, {len(res.objective):,} characters (--json's objective holds it); as written "
                "above    (maximized; the loss is its negative)"]
    return [f"  objective  {res.objective}    (maximized; the loss is its negative)"]


@line("params")
def _params(res, evidence):
    return [f"  params     {', '.join(f'{display_name(k)} = {v:.12g}' for k, v in res.params.items()) or 'none'}"]


@line("options")
def _options(res, evidence):
    return ["  options    " + ", ".join(f"@{k} = {v}" for k, v in res.options.items())]


@line("scope")
def _scope_lines(res, evidence):
    return _scope(res.scope, "seq_quantile(" in res.objective)


# what each locality means for a host: what a token's loss reads, and what a loss call must hold
_ACROSS = {"token": "at its own token only", "response": "across its response", "group": "across its prompt's group",
           "batch": "across the whole optimizer batch"}
_WHOLE = {"token": "a host may split the batch anywhere, even a response into chunks of tokens",
          "response": "each loss call must hold whole responses (a host that splits a response into chunks "
                      "of tokens cannot run it)",
          "group": "each loss call must hold whole groups (the compiled loss reduces over what one call holds)",
          "batch": "one loss call must hold the rank's whole optimizer batch (sums all-reduced across ranks)"}
_KEPT = {"groups": ("group", "whole groups"), "batch": ("batch", "the rank's whole batch")}


@line("locality")
def _locality(res, evidence):
    loc = res.locality
    width, through = loc["width"], loc["gradient"]
    text = f"  locality   {width}: a token's loss reads the current policy {_ACROSS[width]}"
    if through != width:
        text += f" (there under sg only: its gradient stays {_ACROSS[through]})"
    wider = [_KEPT[k][1] for k in loc["kept_whole"] if _KEPT[k][0] != width]
    if wider and width == "token":
        return [text + "; a statistic of fixed inputs in it needs " + " and ".join(wider) + " in each loss call"]
    text += f"; {_WHOLE[width]}"
    if width == "batch" and "batch_quantile(" in res.objective:     # an order statistic is not a sum
        text = text.replace("(sums all-reduced across ranks)", "(on one rank: a quantile needs every rank's values)")
    return [text + "".join(f", and a statistic of fixed inputs needs {w}" for w in wider)]


line("advantage")(lambda res, evidence: [f"  advantage  {res.advantage['text']}"])


@line("weight")
def _weight(res, evidence):
    if res.reference is not None and res.reference["own"]:
        return ["", "  induced weight  w = (∂ℓ/∂r)/A of the terms that do not read π_ref, so that "
                "∇ℓ = w·r·A·∇log π + (∂ℓ_ref/∂log π)·∇log π (the reference terms' own channel below: nothing about "
                "w reads it)", f"    w = {_weight_text(res)}"]
    return ["", "  induced weight  w = (∂ℓ/∂r)/A, so that ∇ℓ = w·r·A·∇log π", f"    w = {_weight_text(res)}"]


@line("entropy")
def _entropy(res, evidence):
    return ["", "  entropy channel  w_H = ∂ℓ/∂H, so that ∇ℓ = w·r·A·∇log π + w_H·∇H "
                "(H's own gradient, beside w's)",
            f"    w_H = {_formula(res.entropy['w_H'])}", _checked(res.entropy["check"])]


@line("reference")
def _reference(res, evidence):
    ref = res.reference
    said = "are their own channel beside w·r·A, " if ref["own"] else "give w·r·A the part "
    return ["", f"  reference  the terms that read π_ref, {ref['terms']}, {said}∂ℓ_ref/∂log π "
            "(π_ref fixed), in q = π_ref/π",
            f"    ∂ℓ_ref/∂log π = {_formula(ref['grad'])}", _checked(ref["check"])]


def _formula(e) -> str:
    return "(not derived: see notes)" if e is None else clip_text(math_text(e, weight=True))


def _checked(c) -> str:
    """How a channel's formula is known (analysis.symbolic.channels): finite differences confirm it, or not."""
    if c["status"] == "not derived":
        return "    (nothing to check)"
    said = "DISAGREES" if c["status"] == "disagrees" else c["status"]
    too_few = "; too few points where ℓ is a finite double" if c["status"] == "unconfirmed" else ""
    return f"    ({said}: {c['method']}, at {c['points']} random points, max rel. error {c['max_rel_error']:.1e}{too_few})"


@line("cases")
def _cases(res, evidence):
    lines = ["", "  cases"] + ["    (not derived: see notes)"] * (not res.cases)
    for c in res.cases:
        sign = "A > 0" if c["advantage"] == "positive" else "A < 0"
        r_side = ("r > 1" if (c["advantage"] == "positive") == (c["direction"] == "diverging") else "r < 1")
        lines.append(f"    {sign}, {c['direction']:<10} ({r_side})   w = {clip_text(math_text(c['weight'], weight=True))}")
    return lines


@line("boundary")
def _boundary(res, evidence):
    lines = ["", "  trust-region boundary (w = 0)"]
    for adv in ("positive", "negative"):
        b = res.boundary[adv]
        sign = "A > 0" if adv == "positive" else "A < 0"
        if not b["r"] and not b["numeric"]:
            c = evidence[adv]
            what = "none: w = 0 everywhere" if c["claim"] == "w ≡ 0" else "none"
            lines.append(f"    {sign}   {what} ({_status(c)})")
        for r_, pi_, kind, ok, how in zip(b["r"], b["pi"], b["kind"], b["reachable"], res.claims["reachable"][adv]):
            reach = "reachable" if ok else f"unreachable in 0 < μ, π ≤ 1, {_status(how)}"
            lines.append(f"    {sign}   r: {math_text(r_)}    π: {math_text(pi_)}    ({reach}; w {kinds(kind)})")
        for x in b["numeric"]:
            lines.append(f"    {sign}   {x['where']}    (found numerically, not derived; w {kinds(x['kind'])})")
    return lines


@line("range")
def _range_line(res, evidence):
    return ["", f"  range      w ∈ {weight_range(res)}  ({BOUNDED[res.bounded]}; {_status(evidence)})"]


@line("smooth")
def _smooth_line(res, evidence):
    return [f"  smooth     {_smooth(res)} ({_status(evidence)})"]


@line("geometry")
def _geometry(res, evidence):
    return [f"  geometry   {res.geometry}: {GEOMETRY[res.geometry]}"]


@line("on_policy")
def _on_policy_line(res, evidence):
    return [f"  on policy  w(r = 1) {on_policy(res.on_policy)}"]


@line("self_check")
def _self_check(res, evidence):
    sc = res.self_check
    return [f"  self-check {sc['status'] if sc['status'] != 'failed' else 'FAILED'}: w·A matches finite differences "
            f"of the objective at {sc['points']} random points (max rel. error {sc['max_rel_error']:.1e})"
            + (": too few points where the objective is a finite double" if sc["status"] == "unconfirmed" else "")]


@line("arbiter")
def _arbiter_line(res, evidence):
    return [f"  checked    {_arbiter(res.arbiter)}"]


@line("admissibility")
def _admissibility_lines(res, evidence):
    return _admissibility(res.admissibility)


line("memory")(lambda res, evidence: memory_evidence(res.memory))


@line("warnings")
def _warnings(res, evidence):
    return ["", "  warnings"] + [f"    ! {alert_text(a)}" for a in res.warnings] if res.warnings else []


@line("notes")
def _notes(res, evidence):
    return ["", "  notes"] + [f"    - {n}" for n in res.notes] if res.notes else []


@line("scenarios")
def _scenarios(res, evidence):
    return ["", *scenario_evidence(res.scenarios)]


def _lines_shown() -> dict:
    """Each report line's declared field, checked against LINES: a field whose line the report
    lacks, or a line no field declares, fails here."""
    shown = {f.metadata["line"]: f for f in fields(Analysis) if f.metadata["line"]}
    if shown.keys() != LINES.keys():
        raise TypeError(f"analysis.result declares report lines {sorted(shown)}, analysis.present.report has {sorted(LINES)}")
    return shown


def report(res: Analysis, width: int | None = WIDTH) -> str:
    """The summary (analysis.present.summary), then the evidence: each declared line but those the summary
    shows (the title, the warnings), a line past `width` columns wrapped under its value (None:
    no line wrapped, what a test reads line by line)."""
    shown = _lines_shown()
    out = summary(res, res.source or "", width) + ["", "evidence"]
    for name, render in LINES.items():
        meta = shown[name].metadata
        if name in ("title", "warnings") or (meta["optional"] and getattr(res, shown[name].name) is None):
            continue
        out += render(res, res.claims[meta["evidence"]] if meta["evidence"] else None)
    return "\n".join(w for line in out for w in (_wrapped(line, width) if width and len(line) > width else [line]))


def _wrapped(line: str, width: int) -> list[str]:
    """An evidence line in `width` columns: continued under its value (after its label's run of spaces)."""
    label = re.match(r"^(\s*(?:[!-] |\S+(?: \S+)*?\s{2,}|))", line).group(1)
    return wrap(line[len(label):], label, " " * max(len(label), len(line) - len(line.lstrip()) + 2), width)


def to_json(res: Analysis) -> dict:
    """The JSON form: each declared field under its JSON name, in declaration order."""
    out = {}
    for f in fields(Analysis):
        name, encode = f.metadata["json"], f.metadata["encode"]
        value = getattr(res, f.name)
        if name and not (f.metadata["optional"] and value is None):
            out[name] = encode(value) if encode else value
    return out


def _admissibility(adm) -> list[str]:
    """The properties gate papers derive by hand (analysis.admissibility), each with how it is known
    (at a degenerate held point each carries that status, its method kept as 'basis')."""
    w1, sym, tails = adm["w_at_1"], adm["symmetric_log_r"], adm["tails"]
    words = {"derived": "derived, and confirmed by the IR's float rules", "numeric": "numeric"}
    how = lambda x: f"{x['status']}; {words[x['basis']]}" if "basis" in x else words[x["status"]]  # noqa: E731
    lo, hi = adm["bounded"]["range"]
    sure = "" if adm["bounded"]["status"] == "proven" else f" ({adm['bounded']['status']}, as the range above)"
    bounded = {True: f"yes: w ∈ [{fmt(lo)}, {fmt(hi)}]{sure}", None: "unknown"}.get(
        adm["bounded"]["value"], f"no: w ∈ [{'-∞' if lo is None else fmt(lo)}, {'+∞' if hi is None else fmt(hi)}]")
    # a w(1) that is not 1 never prints as 1 ("no: 1"): 12 digits where 6 would round it there
    near = lambda x: f"{float(x):.12g}" if x is not None and fmt(x) == "1" and float(x) != 1 else fmt(x)  # noqa: E731
    at_one = ("yes, for both signs of A" if w1["value"] else
              "no: " + ", ".join(f"{near(w[0]) if near(w[0]) == near(w[1]) else f'{near(w[0])} to {near(w[1])}'} for "
                                 f"{'A > 0' if adv == 'positive' else 'A < 0'}" for adv, w in w1["w"].items()))
    sides = [(adv, "A > 0" if adv == "positive" else "A < 0") for adv in ("positive", "negative")]
    symmetric = "yes, for both signs of A"
    if not sym["value"]:
        parts = []
        for adv, text in sides:
            x = sym["by_sign"][adv]["example"]
            parts.append(f"{text} yes" if x is None else
                         f"{text} no (μ = {x['mu']:g}, |A| = {abs(x['A']):g}: w({x['r']:.4g}) = {_value(x['w'][0])}, "
                         f"w(1/{x['r']:.4g}) = {_value(x['w'][1])})")
        symmetric = "; ".join(parts)
    smp = tails["samples"]
    return [
        "", "  admissibility",
        f"    w(1) = 1            {at_one} ({how(w1)}: r = 1 at μ ∈ [1e-6, 1], |A| ∈ [1e-3, 1e3])",
        f"    bounded             {bounded}" + (f" ({adm['bounded']['status']})" if "basis" in adm["bounded"] and adm["bounded"]["value"] is not True else ""),
        "    tail r → 0          " + "; ".join(f"{t}: {_tail(tails['by_sign'][a]['zero'])}" for a, t in sides),
        "    tail r → 1/μ        " + "; ".join(f"{t}: {_tail(tails['by_sign'][a]['infinity'])}" for a, t in sides)
        + " (π = 1, μ → 0)",
        f"    symmetric in log r  {symmetric} ({how(sym)}: w(e^t) against w(e^−t) inside the domain)",
        f"    (tails {how(tails)}: log|w| against log r, r from {smp['r'][0]:g} to 0.1 at μ ∈ "
        f"{{{', '.join(f'{m:g}' for m in smp['mu'])}}}, and along π = 1 from r = 10 to {smp['r'][1]:g}; "
        f"|A| ∈ {{{magnitudes(smp['magnitudes'])}}})",
    ]


def _value(x) -> str:
    return "undefined" if x is None else fmt(x)


def _tail(t) -> str:
    kind = t["kind"]
    if kind == "varies":
        return "varies with μ or |A| (" + ", ".join(t["kinds"]) + ")"
    order = ""
    if t.get("order"):
        lo, hi = t["order"]
        order = f" (order {lo:g})" if lo == hi else f" (order {lo:g} to {hi:g})"
        order = order[:-1] + (", drifting: a logarithmic factor)" if not t.get("steady", True) else ")")
    note = f", {t['note']}" if t.get("note") else ""
    if kind == "tends to a constant":
        lo, hi = t["value"]
        value = fmt(lo) if fmt(lo) == fmt(hi) else f"from {fmt(lo)} to {fmt(hi)} (with μ or |A|)"
        return f"tends to a constant, {value}{note}"
    if kind == "grows":
        to = {1: "+∞", -1: "−∞"}.get(t.get("sign"), "±∞")
        return f"grows to {to}{order}{note}"
    return f"{kind}{order}{note}"


def _scope(scope, quantile=False) -> list[str]:
    """What a sequence or mismatch objective's analysis stands for (openrlhf_drpo.analysis.batch.view.analysis_view)."""
    out = []
    if scope["sequence"]:
        out += [f"  sequence   analysed on a response whose tokens share r, μ and A (|y| = {scope['seq_len']:g}; "
                f"--seq-len): there seq_mean(x) = seq_max(x) = seq_min(x){' = seq_quantile(x, q)' * quantile} = x",
                "             and seq_sum(x) = |y|·x, r is the response's ratio (GSPO's s), and each token's gradient is "
                "w·r·A times its aggregation weight, as for a token; on other responses it also depends on the rest "
                "of the response"]
    if scope.get("held"):
        out += ["  assumed    its group, batch and prefix reductions, π_ref, H and Σ_v π_v² are analysed on a uniform batch (N responses in groups "
                "of G, each of |y| tokens that share r, μ and A), and the claims below hold there only:"]
        out += [f"             - {h['text']}" for h in scope["held"]]
        out += [f"             {scope['exact']}"]
    if scope["rho_name"]:
        m = scope["mismatch_range"]
        lo, hi = m["w"]
        kept = ("w = 0 for every ρ" if m["kept"] is None else
                "nonzero over the whole grid" if m["kept"] == [m["grid"][0], m["grid"][1]] else
                f"nonzero only for ρ ∈ [{fmt(m['kept'][0])}, {fmt(m['kept'][1])}]")
        out += [f"  mismatch   ρ = π_old/π_rollout, held at {scope['rho']:g} above (--rho); on policy (r = 1), over "
                f"ρ ∈ [{fmt(m['grid'][0])}, {fmt(m['grid'][1])}], μ ∈ [1e-6, 1], A = ±1:",
                f"             w ∈ [{fmt(lo)}, {fmt(hi)}], {kept} (numeric: {m['grid'][2]} values of ρ, "
                "not derived)"]
    return out


def _weight_text(res) -> str:
    if res.weight is None:
        return "(not derived symbolically: see notes; every finding below is the numeric check's)"
    flag = {"disagrees": "   (DISAGREES with the numeric check: see warnings)",
            "unconfirmed": "   (unconfirmed: w is nowhere a finite double on the grid)"}
    return clip_text(math_text(res.weight, weight=True)) + flag.get(res.arbiter["weight"]["status"], "")


def _smooth(res) -> str:
    if res.smooth:
        return "yes: w is continuous in r wherever it is defined"
    return "no: w has a pole" if res.arbiter["poles"] else "no: w jumps (hard mask or clip)"


def _arbiter(a) -> str:
    """One line: which claims the numeric arbiter confirmed, on how many points."""
    status = {"weight": a["weight"]["status"], "boundaries": a["boundary"], "range": a["range"],
              "continuity": a["smooth"]}
    said = {"confirmed": "agrees", "disagrees": "DISAGREES (numeric shown)", "numeric": "found numerically",
            "unconfirmed": "unconfirmed", "not derived": "not derived"}
    mags = (f"|A| ∈ {{{magnitudes(a['magnitudes'])}}}" if len(a["magnitudes"]) > 1
            else "|A| = 1 (w is the same at |A| = 0.001 and 1000)")
    return (", ".join(f"{k} {said[v][:-1] if k == 'boundaries' and v == 'confirmed' else said[v]}"
                      for k, v in status.items())
            + f", by the IR's float rules on {a['points']:,} grid points over (μ, π), both signs of A, {mags}")

