"""drpo-analyze --equiv's report: the verdict first, then its evidence (analysis.equiv)."""
from __future__ import annotations

from openrlhf_drpo.analysis.mathtext import clip_text, magnitudes


def equivalence_report(res: dict) -> str:
    """drpo-analyze --equiv: the verdict first, then its evidence (analysis.equiv)."""
    a, b = res["names"]
    num, sym = res["numeric"], res["symbolic"]
    situations = res.get("scenarios") or []
    differ = [x for x in situations if x["status"] == "differs"]
    except_ = not num["differs"] and not res["options"] and differ
    verdict = ("equivalent" if res["equivalent"] else
               f"equivalent except on {_titles(differ)}" if except_ else "not equivalent")
    lines = [f"{verdict}: {a} and {b}"]
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
    if sc.get("memory"):     # objectives with memory: at each value their controls and schedules take
        m = sc["memory"]
        same = f"their controllers are the same ({'; '.join(m['controls'])}), " if m["controls"] else ""
        verdict = "the same at each" if res["equivalent"] else f"the verdict below is at {m['at']}"
        lines.append(f"  memory     {same}compared at {'; '.join(m['points'])} (their bounds, first values and "
                     f"schedules' steps; nothing between them): {verdict}")
    rhos = (f" at each ρ = π_old/π_rollout ∈ {{{', '.join(f'{x:g}' for x in num['rhos'])}}} (--rho adds one)"
            if num.get("rhos") else "")
    where = (f"{num['points']:,} points: the numeric check's grid over 0 < μ ≤ 1, 0 < π ≤ 1 with r = 1 and π = 1, "
             f"both signs of A, |A| ∈ {{{magnitudes(num['magnitudes'])}}}, and "
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
                         f"{sym['direction']}: ∂ℓ/∂r({a}) − ∂ℓ/∂r({b}) = {clip_text(sym['difference'])}")
    if num["ties"]:
        lines.append(f"  ties       they differ only at isolated points, {num['ties']}: a threshold's tie (≤ against <), "
                     "not a region")
    lines += _scenario_lines(res, situations, a, b)
    return "\n".join(lines)


def _titles(rows) -> str:
    raw = " with raw advantages" if all("normalized_same" in x for x in rows) else ""
    return " and ".join(x["title"] for x in rows) + raw


def _scenario_lines(res, situations, a, b) -> list[str]:
    """Where the verdict holds: every scenario of both, each differing one with its witness and,
    on a group of equal advantages, what a host that normalizes A within groups makes of it."""
    if not situations:
        return []
    group = f" and at --group {','.join(f'{c:g}' for c in res['group'])}" if res.get("group") else ""
    same = [x["name"] for x in situations if x["status"] == "same"]
    out = []
    if all(x["status"] == "same" for x in situations):
        out.append(f"  scenarios  equivalent on every scenario ({', '.join(same)}){group}: each compared as above")
    elif same:
        out.append(f"  scenarios  the same on {', '.join(same)}{group}")
    for x in situations:
        if x["status"] == "not compared":
            out.append(f"  not compared  {x['title']}: {x['why']}")
        if x["status"] != "differs":
            continue
        w = x["witness"]
        g = ["undefined" if v is None else f"{v:.6g}" for v in w["gradients"]]
        text = (f"  differs    {x['title']}: there ∂ℓ/∂log π = {g[0]} ({a}) vs {g[1]} ({b}) at μ = {w['mu']:.6g}, "
                f"r = {w['r']:.6g}, A = {w['A']:g}")
        if "normalized_same" in x:
            text += ("; a host that normalizes A within groups gives A = 0 there, where the two " +
                     ("agree: the verdict depends on the host's normalization of A" if x["normalized_same"] else
                      "still differ"))
        out.append(text)
    return out


def _symbolic_why(sym) -> str:
    if sym.get("difference"):
        side = "A > 0" if sym["advantage"] == "positive" else "A < 0"
        return f"for {side}, {sym['direction']}, SymPy leaves the difference {clip_text(sym['difference'])}"
    return sym["why"]


def _region(reg, a, b) -> str:
    if reg is None:
        return "the same everywhere sampled"
    span = lambda k: f"{reg[k][0]:.6g} to {reg[k][1]:.6g}"    # noqa: E731
    undefined = [n for n, u in zip((a, b), reg["undefined_in"]) if u]
    mags = magnitudes(reg["magnitudes"]) or "only at random points"
    rs = " and ".join(f"= {lo:.6g}" if lo == hi else f"from {lo:.6g} to {hi:.6g}" for lo, hi in reg["r"])
    return (f"r {rs} (π from {span('pi')}), μ from {span('mu')}, |A| ∈ {{{mags}}}: "
            f"{100 * reg['share']:.3g}% of the points sampled for this sign"
            + (", r = 1 included" if reg["on_policy"] else "")
            + (f"; undefined for {' and '.join(undefined)} at some of them" if undefined else ""))
