"""The warnings a result raises: what it says to watch for (a boundary that cannot be
reached, an unbounded weight, a claim the arbiter disagrees with, ...), decided from the
result's own fields."""
from __future__ import annotations

from .mathtext import fmt, math_text


def _how(claims) -> str:
    """A warning's claim of absence says whether it is proven; the evidence is printed once, under
    the boundary it concerns."""
    proven = all(c["status"] == "proven" for c in claims)
    return " (proven)" if proven else " (unconfirmed: evidence under the boundary above)"


def result_warnings(res, exact_range) -> list[str]:
    out = []
    lo, hi = res["weight_range"]
    for adv, sign_text in (("positive", "A > 0"), ("negative", "A < 0")):
        b = res["boundary"][adv]
        if not b["pi"] and not b["numeric"]:
            c = res["claims"]["boundary"][adv]
            how = _how([c])
            if c["claim"] == "w ≡ 0":
                out.append(f"for {sign_text}, w = 0 everywhere: these tokens get no gradient at all{how}")
            elif c["zero_share"] > 0:
                out.append(f"no trust-region boundary for {sign_text}, but w = 0 on part of the domain "
                           f"({100 * c['zero_share']:.3g}% of the grid points): those tokens get no gradient{how}")
            elif res["on_policy"][adv]["status"] == "zero":
                out.append(f"no trust-region boundary for {sign_text}: w = 0 at r = 1 (see on policy) but does not "
                           f"change sign, so nothing stops the update{how}")
            elif c["touches"]:
                out.append(f"no trust-region boundary for {sign_text}: w reaches 0 only where it touches 0, "
                           f"so nothing stops the update{how}")
            elif res["geometry"] != "none":
                out.append(f"no trust-region boundary for {sign_text}: w never reaches 0, so nothing stops the update{how}")
        elif not res["reachable"][adv]:
            shown = ", ".join(f"π = {math_text(p)}" for p in b["pi"])
            out.append(f"the boundary for {sign_text} ({shown}) is unreachable: 0 < π, μ ≤ 1, "
                       f"so w stays within [{fmt(lo)}, {fmt(hi)}] and never cancels the gradient"
                       + _how(res["claims"]["reachable"][adv]))
        elif not all(b["reachable"]):
            shown = ", ".join(f"π = {math_text(p)}" for p, ok in zip(b["pi"], b["reachable"]) if not ok)
            how = [c for c, ok in zip(res["claims"]["reachable"][adv], b["reachable"]) if not ok]
            out.append(f"for {sign_text}, the boundary {shown} is unreachable in 0 < π, μ ≤ 1" + _how(how))
        if b["numeric"]:
            found = "; ".join(f"{x['where']} ({x['kind']})" for x in b["numeric"])
            out.append(f"for {sign_text}, the numeric arbiter finds w changing sign at {found}" +
                       (": the symbolic derivation found no boundary there" if res["weight"] is not None else ""))
    if res["bounded"] is None:
        out.append("w is not a finite double at any sampled point: its range is unknown")
    elif not res["bounded"]:
        out.append(f"w is unbounded (range [{fmt(lo)}, {fmt(hi)}]): tokens with extreme ratios "
                   "(rare tokens, small μ) can dominate the gradient")
    if res["geometry"] == "advantage-entangled":
        out.append("the weight depends on |A|: the trust region moves with the advantage's magnitude")
    if not all(exact_range) and None not in (lo, hi):
        out.append("the range is numeric (sampled over the domain), not an exact bound")
    wc = res["arbiter"]["weight"]
    if wc["status"] == "disagrees":
        x = wc["example"]
        out.append(f"THE DERIVED WEIGHT DISAGREES with the IR's own derivative at {wc['bad_points']} of "
                   f"{wc['points']} grid points, e.g. μ = {x['mu']:.6g}, π = {x['pi']:.6g}, A = {x['A']:g}: "
                   f"derived {x['derived']:.6g}, numeric {x['numeric']:.6g}")
    if res["arbiter"]["range"] == "disagrees":
        out.append("the derived range disagreed with the numeric arbiter (whose extremes are refined between "
                   "grid points); the arbiter's is shown")
    if res["self_check"]["status"] == "failed":
        out.append("SELF-CHECK FAILED: the derived weight disagrees with finite differences of the objective")
    elif res["self_check"]["status"] == "unconfirmed":
        out.append("the weight is unconfirmed: too few points where the objective is a finite double to check it")
    return out
