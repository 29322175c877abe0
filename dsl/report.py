"""Human-readable output of an analysis: the report, the comparison table and the plot."""
from __future__ import annotations

from .mathtext import fmt, math_text
from .names import display_name

_GEOMETRY = {
    "none": "w ≡ 1: the plain surrogate, no trust region",
    "ratio": "boundaries are fixed values of r = π/μ (PPO/SPO-like)",
    "binary-tv": "boundaries are fixed values of |π − μ| (DPPO/DRPO-like)",
    "two-level": "w takes two constant values switching at r = 1",
    "advantage-entangled": "a boundary or the weight depends on |A|",
    "other": "none of the named geometries",
}


# what w does at a boundary, as the arbiter saw it
_KIND = {"crosses 0": "crosses 0", "jumps across 0": "jumps across 0", "w = 0 beyond": "is 0 beyond it",
         "w = 0 before": "is 0 before it (nearer r = 1)",
         "unconfirmed": "is unconfirmed there (ℓ is not a finite double)"}


def _kinds(kind: str) -> str:
    return " or ".join(_KIND[k] for k in kind.split(", "))


def _status(claim) -> str:
    """How a claim is known (dsl.analysis._claims): proven, found at located points, or
    unconfirmed, with the evidence it rests on."""
    return f"{claim['status']}: {claim['evidence']}"


def _on_policy(facts) -> str:
    parts = []
    for adv, sign in (("positive", "A > 0"), ("negative", "A < 0")):
        f = facts[adv]
        lo, hi = f["w"]
        value = ("undefined" if f["status"] == "undefined" else fmt(lo) if fmt(lo) == fmt(hi)
                 else f"from {fmt(lo)} to {fmt(hi)} (with μ, |A|)")
        parts.append(f"{value} for {sign}")
    return ", ".join(parts)


_BOUNDED = {True: "bounded", False: "unbounded", None: "not a finite double where sampled"}


def _range(res) -> str:
    if res["bounded"] is None:
        return "unknown"
    lo, hi = res["weight_range"]
    return f"[{'-∞' if lo is None else fmt(lo)}, {'+∞' if hi is None else fmt(hi)}]"


def report(res: dict) -> str:
    title = res["description"].splitlines()[0] if res["description"] else res["name"]
    lines = [f"{res['name']} — {title}", f"  file       {res['path']}"]
    params = ", ".join(f"{display_name(k)} = {v:g}" for k, v in res["params"].items()) or "none"
    lines += [
        f"  objective  {res['objective']}    (maximized; the loss is its negative)",
        f"  params     {params}",
        "  options    " + ", ".join(f"@{k} = {v}" for k, v in res["options"].items()),
        *_scope(res["scope"]),
        "",
        "  induced weight  w = (∂ℓ/∂r)/A, so that ∇ℓ = w·r·A·∇log π",
        f"    w = {_weight_text(res)}",
        "",
        "  cases",
    ]
    if not res["cases"]:
        lines.append("    (not derived: see notes)")
    for c in res["cases"]:
        sign = "A > 0" if c["advantage"] == "positive" else "A < 0"
        r_side = ("r > 1" if (c["advantage"] == "positive") == (c["direction"] == "diverging") else "r < 1")
        lines.append(f"    {sign}, {c['direction']:<10} ({r_side})   w = {_clip_text(math_text(c['weight'], weight=True))}")
    lines += ["", "  trust-region boundary (w = 0)"]
    for adv in ("positive", "negative"):
        b = res["boundary"][adv]
        sign = "A > 0" if adv == "positive" else "A < 0"
        claims = res["claims"]
        if not b["r"] and not b["numeric"]:
            c = claims["boundary"][adv]
            what = "none: w = 0 everywhere" if c["claim"] == "w ≡ 0" else "none"
            lines.append(f"    {sign}   {what} ({_status(c)})")
        for r_, pi_, kind, ok, how in zip(b["r"], b["pi"], b["kind"], b["reachable"], claims["reachable"][adv]):
            reach = "reachable" if ok else f"unreachable in 0 < μ, π ≤ 1, {_status(how)}"
            lines.append(f"    {sign}   r: {math_text(r_)}    π: {math_text(pi_)}    ({reach}; w {_kinds(kind)})")
        for x in b["numeric"]:
            lines.append(f"    {sign}   {x['where']}    (found numerically, not derived; w {_kinds(x['kind'])})")
    sc = res["self_check"]
    lines += [
        "",
        f"  range      w ∈ {_range(res)}  ({_BOUNDED[res['bounded']]}; {_status(res['claims']['bounded'])})",
        f"  smooth     {_smooth(res)} ({_status(res['claims']['smooth'])})",
        f"  geometry   {res['geometry']}: {_GEOMETRY[res['geometry']]}",
        f"  on policy  w(r = 1) {_on_policy(res['on_policy'])}",
        f"  self-check {sc['status'] if sc['status'] != 'failed' else 'FAILED'}: w·A matches finite differences "
        f"of the objective at {sc['points']} random points (max rel. error {sc['max_rel_error']:.1e})"
        + (": too few points where the objective is a finite double" if sc["status"] == "unconfirmed" else ""),
        f"  arbiter    {_arbiter(res['arbiter'])}",
    ]
    lines += _admissibility(res["admissibility"])
    if res["warnings"]:
        lines += ["", "  warnings"] + [f"    ! {w}" for w in res["warnings"]]
    if res["notes"]:
        lines += ["", "  notes"] + [f"    - {n}" for n in res["notes"]]
    return "\n".join(lines)


def _admissibility(adm) -> list[str]:
    """The properties gate papers derive by hand (dsl.analysis.admissibility), each with how it is known."""
    w1, sym, tails = adm["w_at_1"], adm["symmetric_log_r"], adm["tails"]
    how = {"derived": "derived, and confirmed by the IR's float rules", "numeric": "numeric"}
    lo, hi = adm["bounded"]["range"]
    bounded = {True: f"yes: w ∈ [{fmt(lo)}, {fmt(hi)}]", None: "unknown"}.get(
        adm["bounded"]["value"], f"no: w ∈ [{'-∞' if lo is None else fmt(lo)}, {'+∞' if hi is None else fmt(hi)}]")
    at_one = ("yes, for both signs of A" if w1["value"] else
              "no: " + ", ".join(f"{fmt(w[0]) if fmt(w[0]) == fmt(w[1]) else f'{fmt(w[0])} to {fmt(w[1])}'} for "
                                 f"{'A > 0' if adv == 'positive' else 'A < 0'}" for adv, w in w1["w"].items()))
    sides = [(adv, "A > 0" if adv == "positive" else "A < 0") for adv in ("positive", "negative")]
    if sym["value"]:
        symmetric = "yes, for both signs of A"
    else:
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
        f"    w(1) = 1            {at_one} ({how[w1['status']]}: r = 1 at μ ∈ [1e-6, 1], |A| ∈ [1e-3, 1e3])",
        f"    bounded             {bounded}",
        "    tail r → 0          " + "; ".join(f"{t}: {_tail(tails['by_sign'][a]['zero'])}" for a, t in sides),
        "    tail r → 1/μ        " + "; ".join(f"{t}: {_tail(tails['by_sign'][a]['infinity'])}" for a, t in sides)
        + " (π = 1, μ → 0)",
        f"    symmetric in log r  {symmetric} ({how[sym['status']]}: w(e^t) against w(e^−t) inside the domain)",
        f"    (tails numeric: log|w| against log r, r from {smp['r'][0]:g} to 0.1 at μ ∈ "
        f"{{{', '.join(f'{m:g}' for m in smp['mu'])}}}, and along π = 1 from r = 10 to {smp['r'][1]:g}; "
        f"|A| ∈ {{{_mags(smp['magnitudes'])}}})",
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


def _scope(scope) -> list[str]:
    """What a sequence or mismatch objective's analysis stands for (dsl.analysis.analysis_view)."""
    out = []
    if scope["sequence"]:
        out += [f"  sequence   analysed on a response whose tokens share r, μ and A (|y| = {scope['seq_len']:g}; "
                "--seq-len): there seq_mean(x) = seq_max(x) = seq_min(x) = x",
                "             and seq_sum(x) = |y|·x, r is the response's ratio (GSPO's s), and each token's gradient is "
                "w·r·A times its aggregation weight, as for a token; on other responses it also depends on the rest "
                "of the response"]
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


def _view_title(scope) -> str:
    parts = [f"one response, |y| = {scope['seq_len']:g}"] if scope["sequence"] else []
    parts += [f"ρ = {scope['rho']:g}"] if scope["rho_name"] else []
    return f" ({', '.join(parts)})" if parts else ""


REPORT_WIDTH = 2000    # characters of one formula in the text report; --json has it whole


def _clip_text(text: str) -> str:
    return text if len(text) <= REPORT_WIDTH else text[:REPORT_WIDTH] + f"… ({len(text):,} characters; --json has it whole)"


def _weight_text(res) -> str:
    if res["weight"] is None:
        return "(not derived symbolically: see notes; every finding below is the numeric arbiter's)"
    flag = {"disagrees": "   (DISAGREES with the numeric arbiter: see warnings)",
            "unconfirmed": "   (unconfirmed: w is nowhere a finite double on the grid)"}
    return _clip_text(math_text(res["weight"], weight=True)) + flag.get(res["arbiter"]["weight"]["status"], "")


def _smooth(res) -> str:
    if res["smooth"]:
        return "yes: w is continuous in r wherever it is defined"
    return "no: w has a pole" if res["arbiter"]["poles"] else "no: w jumps (hard mask or clip)"


def _arbiter(a) -> str:
    """One line: which claims the numeric arbiter confirmed, on how many points."""
    status = {"weight": a["weight"]["status"], "boundaries": a["boundary"], "range": a["range"],
              "continuity": a["smooth"]}
    said = {"confirmed": "confirmed", "disagrees": "DISAGREES (numeric shown)", "numeric": "found numerically",
            "unconfirmed": "unconfirmed", "not derived": "not derived"}
    mags = (f"|A| ∈ {{{_mags(a['magnitudes'])}}}" if len(a["magnitudes"]) > 1
            else "|A| = 1 (w is the same at |A| = 0.001 and 1000)")
    return (", ".join(f"{k} {said[v]}" for k, v in status.items())
            + f", by the IR's float rules on {a['points']:,} grid points over (μ, π), both signs of A, {mags}")


def comparison(results: list[dict]) -> str:
    """One row per objective, side by side."""
    head = ["objective", "w range", "boundary A>0 (π)", "boundary A<0 (π)", "smooth", "bounded", "geometry"]
    rows = [head]
    for res in results:
        def side(adv):
            pis = res["boundary"][adv]["pi"]
            if not pis:
                return "none"
            text = ", ".join(math_text(p) for p in pis)
            return text if res["reachable"][adv] else f"{text} (unreachable)"
        rows.append([res["name"], _range(res), side("positive"), side("negative"),
                     "yes" if res["smooth"] else "no", {True: "yes", False: "no", None: "unknown"}[res["bounded"]], res["geometry"]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows[1:]])


PLOT_DPI, PANEL_W, PANEL_H = 100, 5.0, 4.0


def plot(results: list[dict], path: str) -> None:
    """Heatmaps of w over (μ, π) for A = +1 and A = −1, one row per objective, evaluated by the
    numeric arbiter (the IR's float rules). Each objective has its own colour scale (its 1st to
    99th percentile of w, diverging around 1, the plain surrogate, when it spans 1); the black
    contour is where w changes sign or becomes 0 (the boundary, as found numerically), and
    hatching marks where ℓ or w is undefined. Size: 1000 × 400·rows pixels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize, TwoSlopeNorm
    n = len(results)
    fig, axes = plt.subplots(n, 2, figsize=(2 * PANEL_W, PANEL_H * n), dpi=PLOT_DPI, squeeze=False)
    grid = np.linspace(0.002, 1.0, 300)
    mu, pi = np.meshgrid(grid, grid)
    for row, res in zip(axes, results):
        ws = [np.asarray(res["_w_numeric"](pi / mu, mu, A), dtype=float) for A in (1.0, -1.0)]
        finite = np.concatenate([w[np.isfinite(w)] for w in ws])
        lo, hi = (np.percentile(finite, [1, 99]) if finite.size else (0.0, 2.0))
        # to 9 digits: a w of 1 ± rounding (exp(log π − log μ) is r to 1 ulp) is one colour, not two
        lo, hi = (float(f"{x:.9g}") for x in (lo, hi))
        lo, hi = (lo - 0.5, hi + 0.5) if hi - lo < 1e-9 else (lo, hi)
        norm = TwoSlopeNorm(1.0, lo, hi) if lo < 1 < hi else Normalize(lo, hi)
        for ax, A, w in zip(row, (1.0, -1.0), ws):
            im = ax.imshow(np.ma.masked_invalid(w), origin="lower", extent=(0, 1, 0, 1), cmap="RdBu_r",
                           norm=norm, aspect="auto")
            sign = np.where(np.isfinite(w), np.sign(w), np.nan)
            if np.nanmin(sign, initial=1) < 1 and np.nanmax(sign, initial=-1) > -1 + (np.nanmin(sign, initial=1) < 0):
                ax.contour(mu, pi, np.ma.masked_invalid(sign), levels=[-0.5, 0.5], colors="k", linewidths=1.5)
            if np.isnan(w).any():
                ax.contourf(mu, pi, np.isnan(w).astype(float), levels=[0.5, 1.5], colors="none",
                            hatches=["///"])
            ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls=":")
            ax.set_title(f"{res['name']}: w for A {'> 0' if A > 0 else '< 0'}{_view_title(res['scope'])}"
                         + ("  (hatched: undefined)" if np.isnan(w).any() else ""), fontsize=10)
            ax.set_xlabel("μ (behaviour prob.)")
            ax.set_ylabel("π (current prob.)")
            fig.colorbar(im, ax=ax, fraction=0.046).set_label("w = (∂ℓ/∂r)/A")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def equivalence_report(res: dict) -> str:
    """drpo-analyze --equiv: the verdict first, then its evidence (dsl.equiv)."""
    a, b = res["names"]
    num, sym = res["numeric"], res["symbolic"]
    lines = [f"{'equivalent' if res['equivalent'] else 'not equivalent'}: {a} and {b}"]
    if res["options"]:
        lines.append("  options    differ: " + "; ".join(f"@{o['option']} = {o['values'][0]} ({a}) vs {o['values'][1]} ({b})"
                                                      for o in res["options"]))
    else:
        lines.append("  options    the same: " + ", ".join(f"@{k} = {v}" for k, v in res["options_shown"].items()))
    sc = res["scope"]
    if sc["sequence"]:
        lines.append(f"  scope      compared on a response whose |y| = {sc['seq_len']:g} tokens share r, μ and A "
                     "(--seq-len); on other responses a token's gradient also depends on the rest of its response, "
                     "which this does not compare")
    rhos = (f" at each ρ = π_old/π_rollout ∈ {{{', '.join(f'{x:g}' for x in num['rhos'])}}} (--rho adds one)"
            if num.get("rhos") else "")
    where = (f"{num['points']:,} points: the arbiter's grid over 0 < μ ≤ 1, 0 < π ≤ 1 with r = 1 and π = 1, "
             f"both signs of A, |A| ∈ {{{_mags(num['magnitudes'])}}}, and "
             f"{num['random_points']:,} seeded random points{rhos}; relative tolerance {num['rtol']:g}")
    if not num["differs"]:
        lines.append("  gradient   ∂ℓ/∂log π is the same (the losses may differ by a term without a gradient)")
        if sym["status"] == "proven":
            ties = f", except at the ties r = {', '.join(sym['ties'])} (≤ against <)" if sym["ties"] else ""
            held = f" at ρ = {sc['rho']:g}" if sc["mismatch"] else ""
            lines.append("  proof      symbolic: ∂ℓ/∂r of the two differ by 0 in each case (A > 0 and A < 0, r > 1 and "
                         f"r < 1; SymPy, the IR's derivative rules){held}{ties}; r = 1 itself numerically")
        else:
            lines.append(f"  proof      not symbolic ({_symbolic_why(sym)}): the evidence is numeric")
        lines.append(f"  numeric    the same at all {where}")
    else:
        w = num["witness"]
        g = ["undefined" if x is None else f"{x:.6g}" for x in w["gradients"]]
        lines.append(f"  gradient   differs at {num['differing_points']:,} of {where}")
        rho = f", ρ = {w['rho']:g}" if num.get("rhos") else ""
        lines.append(f"  witness    μ = {w['mu']:.6g}, π = {w['pi']:.6g} (r = {w['r']:.6g}), A = {w['A']:g}{rho}: "
                     f"∂ℓ/∂log π = {g[0]} ({a}) vs {g[1]} ({b})")
        for adv, sign in (("positive", "A > 0"), ("negative", "A < 0")):
            lines.append(f"  {'region' if adv == 'positive' else '':<10} {sign}: {_region(res['numeric']['region'][adv], a, b)}")
        undefined = any(reg and any(reg["undefined_in"]) for reg in num["region"].values())
        if sym["status"] == "proven" and (num["only_on_policy"] or undefined) and not num.get("rhos"):
            lines.append("  symbolic   ∂ℓ/∂r of the two differ by 0 for r ≠ 1 (SymPy): they differ " +
                         ("at r = 1 exactly, where every step's first mini-batch sits" if num["only_on_policy"]
                          else "where one of them is not a finite double"))
        elif sym.get("difference") and num["region"][sym["advantage"]] is not None and w.get("rho", res["scope"]["rho"]) == res["scope"]["rho"]:
            # a piece SymPy leaves nonzero is shown only where the numbers differ too (its
            # condition may be empty in the domain, e.g. at π > 1)
            lines.append(f"  symbolic   for {'A > 0' if sym['advantage'] == 'positive' else 'A < 0'}, "
                         f"{sym['direction']}: ∂ℓ/∂r({a}) − ∂ℓ/∂r({b}) = {_clip_text(sym['difference'])}")
    if num["ties"]:
        lines.append(f"  ties       they differ only at isolated points, {num['ties']}: a threshold's tie (≤ against <), "
                     "not a region")
    return "\n".join(lines)


def _symbolic_why(sym) -> str:
    if sym.get("difference"):
        side = "A > 0" if sym["advantage"] == "positive" else "A < 0"
        return f"for {side}, {sym['direction']}, SymPy leaves the difference {_clip_text(sym['difference'])}"
    return sym["why"]


def _region(reg, a, b) -> str:
    if reg is None:
        return "the same everywhere sampled"
    span = lambda k: f"{reg[k][0]:.6g} to {reg[k][1]:.6g}"    # noqa: E731
    undefined = [n for n, u in zip((a, b), reg["undefined_in"]) if u]
    mags = _mags(reg["magnitudes"]) or "only at random points"
    rs = " and ".join(f"= {lo:.6g}" if lo == hi else f"from {lo:.6g} to {hi:.6g}" for lo, hi in reg["r"])
    return (f"r {rs} (π from {span('pi')}), μ from {span('mu')}, |A| ∈ {{{mags}}}: "
            f"{100 * reg['share']:.3g}% of the points sampled for this sign"
            + (", r = 1 included" if reg["on_policy"] else "")
            + (f"; undefined for {' and '.join(undefined)} at some of them" if undefined else ""))


def _mags(values) -> str:
    """|A| values as printed, each once: both sides of a threshold (2 ± 2e-6) read 2."""
    return ", ".join(dict.fromkeys(f"{m:g}" for m in values))
