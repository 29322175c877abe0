"""Human-readable output of an analysis: the report, the comparison table and the plot."""
from __future__ import annotations

import re
from decimal import Decimal

from .ir import display_name

_FUNCS = {"Piecewise", "sign", "Abs", "log", "exp", "sqrt", "Min", "Max", "Eq", "LambertW", "True", "False"}
_GEOMETRY = {
    "none": "w ≡ 1: the plain surrogate, no trust region",
    "ratio": "boundaries are fixed values of r = π/μ (PPO/SPO-like)",
    "binary-tv": "boundaries are fixed values of |π − μ| (DPPO/DRPO-like)",
    "two-level": "w takes two constant values switching at r = 1",
    "advantage-entangled": "a boundary or the weight depends on |A|",
    "other": "none of the named geometries",
}


def _decimal(m):
    p, q = int(m.group(1)), int(m.group(2))
    d = q
    for f in (2, 5):
        while d % f == 0:
            d //= f
    return f"{p / q:g}" if d == 1 else m.group(0)


def math_text(e, weight: bool = False) -> str:
    """One-line Unicode math: 1 − 0.08·μ·(r − 1), with Piecewise as 'x if c; y otherwise'.
    A weight puts its constant first (1 − ...); a boundary keeps μ + 12.5, as the paper does."""
    import sympy as sp
    if isinstance(e, sp.Piecewise):
        # a nested Piecewise keeps its own brackets: (0 if r > 1.2; 1 otherwise) if A > 0 and r > 1
        inner = lambda x: f"({math_text(x, weight)})" if isinstance(x, sp.Piecewise) else math_text(x, weight)  # noqa: E731
        parts = [f"{inner(x)} if {math_text(c)}" for x, c in e.args[:-1]]
        return "; ".join(parts + [f"{inner(e.args[-1][0])} otherwise"])
    if isinstance(e, sp.Eq):
        return f"{math_text(e.lhs)} = {math_text(e.rhs)}"
    e = _without_pi(sp, e)
    text = sp.sstr(e)
    if weight and isinstance(e, sp.Add):   # the constant first: 1 − 0.08·μ·(r − 1)
        const, rest = e.as_coeff_Add()
        if const != 0 and not rest.is_number:
            tail = sp.sstr(rest)
            text = f"{sp.sstr(const)} - {tail[1:]}" if tail.startswith("-") else f"{sp.sstr(const)} + {tail}"
    # p/q alone, never an exponent's tail: r**2/400 is r²/400, not r^0.005
    text = re.sub(r"(?<![\w.)*])(\d+)/(\d+)(?![\w.(])", _decimal, text)
    text = re.sub(r"(?<![\w.])\d{16,}(?![\w.])", lambda m: f"{Decimal(m.group(0)).normalize():.6g}", text)   # 1e+300, not 301 digits
    text = text.replace("**", "^").replace("*", "·").replace(" - ", " − ").replace("<=", "≤").replace(">=", "≥")
    text = text.replace(" & ", " and ").replace(" | ", " or ").replace("~", "not ")
    text = re.sub(r"\b([A-Za-z][A-Za-z0-9_]*)\b",
                  lambda m: m.group(1) if m.group(1) in _FUNCS else display_name(m.group(1)), text)
    return text.replace("Abs", "abs")


def _without_pi(sp, e):
    """SymPy's constant π (erf's derivative is 2/√π·e^(−x²)) as a 6-digit decimal: printed as
    'pi', it would read as the language's π, the probability."""
    if not isinstance(e, sp.Basic) or not e.has(sp.pi):
        return e
    if e.is_number:
        v = float(f"{float(e):.6g}")
        return sp.Integer(int(v)) if v.is_integer() else sp.Float(v, 6)
    if e.is_Mul:            # the numeric factors as one decimal: 1.12838·exp(−(r − 1)²)
        coeff, rest = e.as_independent(*e.free_symbols)
        return _without_pi(sp, coeff) * e.func(*[_without_pi(sp, a) for a in sp.Mul.make_args(rest)])
    return e.func(*[_without_pi(sp, a) for a in e.args])


# what w does at a boundary, as the arbiter saw it
_KIND = {"crosses 0": "crosses 0", "jumps across 0": "jumps across 0", "w = 0 beyond": "is 0 beyond it",
         "w = 0 before": "is 0 before it (nearer r = 1)",
         "unconfirmed": "is unconfirmed there (ℓ is not a finite double)"}


def _kinds(kind: str) -> str:
    return " or ".join(_KIND[k] for k in kind.split(", "))


def _fmt(x) -> str:
    return "unbounded" if x is None else f"{float(x):.6g}"


def _on_policy(facts) -> str:
    parts = []
    for adv, sign in (("positive", "A > 0"), ("negative", "A < 0")):
        f = facts[adv]
        lo, hi = f["w"]
        value = ("undefined" if f["status"] == "undefined" else _fmt(lo) if _fmt(lo) == _fmt(hi)
                 else f"from {_fmt(lo)} to {_fmt(hi)} (with μ, |A|)")
        parts.append(f"{value} for {sign}")
    return ", ".join(parts)


_BOUNDED = {True: "bounded", False: "unbounded", None: "not a finite double where sampled"}


def _range(res) -> str:
    if res["bounded"] is None:
        return "unknown"
    lo, hi = res["weight_range"]
    return f"[{'-∞' if lo is None else _fmt(lo)}, {'+∞' if hi is None else _fmt(hi)}]"


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
        if not b["r"] and not b["numeric"]:
            lines.append(f"    {sign}   none")
        for r_, pi_, kind, ok in zip(b["r"], b["pi"], b["kind"], b["reachable"]):
            reach = "reachable" if ok else "unreachable in 0 < μ, π ≤ 1"
            lines.append(f"    {sign}   r: {math_text(r_)}    π: {math_text(pi_)}    ({reach}; w {_kinds(kind)})")
        for x in b["numeric"]:
            lines.append(f"    {sign}   {x['where']}    (found numerically, not derived; w {_kinds(x['kind'])})")
    sc = res["self_check"]
    lines += [
        "",
        f"  range      w ∈ {_range(res)}  ({_BOUNDED[res['bounded']]})",
        f"  smooth     {_smooth(res)}",
        f"  geometry   {res['geometry']}: {_GEOMETRY[res['geometry']]}",
        f"  on policy  w(r = 1) {_on_policy(res['on_policy'])}",
        f"  self-check {sc['status'] if sc['status'] != 'failed' else 'FAILED'}: w·A matches finite differences "
        f"of the objective at {sc['points']} random points (max rel. error {sc['max_rel_error']:.1e})"
        + (": too few points where the objective is a finite double" if sc["status"] == "unconfirmed" else ""),
        f"  arbiter    {_arbiter(res['arbiter'])}",
    ]
    if res["warnings"]:
        lines += ["", "  warnings"] + [f"    ! {w}" for w in res["warnings"]]
    if res["notes"]:
        lines += ["", "  notes"] + [f"    - {n}" for n in res["notes"]]
    return "\n".join(lines)


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
                f"nonzero only for ρ ∈ [{_fmt(m['kept'][0])}, {_fmt(m['kept'][1])}]")
        out += [f"  mismatch   ρ = π_old/π_rollout, held at {scope['rho']:g} above (--rho); on policy (r = 1), over "
                f"ρ ∈ [{_fmt(m['grid'][0])}, {_fmt(m['grid'][1])}], μ ∈ [1e-6, 1], A = ±1:",
                f"             w ∈ [{_fmt(lo)}, {_fmt(hi)}], {kept} (numeric: {m['grid'][2]} values of ρ, "
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
    mags = (f"|A| ∈ {{{', '.join(f'{m:g}' for m in a['magnitudes'])}}}" if len(a["magnitudes"]) > 1
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
