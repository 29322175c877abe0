"""What each claim of the analysis rests on.

A claim of absence or a global property ("no boundary", "unreachable", "bounded", "smooth")
is "proven" only from the derived weight (SymPy, confirmed by the arbiter); the grid alone
is evidence, so such a claim is "unconfirmed" and carries where it was looked for. A claim
of existence (a boundary met, a jump, a pole) rests on the points found: "found"."""
from __future__ import annotations

from openrlhf_drpo.analysis.budgets import check_budget, size
from openrlhf_drpo.lang.operations import OPS
from openrlhf_drpo.analysis.symbolic import SIGNS


def grid_evidence(arb) -> str:
    np = arb.np
    r = arb.R[arb.inside]
    mags = ", ".join(dict.fromkeys(f"{m:g}" for m in arb.magnitudes))     # 2 ± 2e-6 read 2, once
    return (f"the arbiter's {int(arb.inside.sum()):,} grid points, μ ∈ [{float(arb.mu.min()):g}, {float(arb.mu.max()):g}], "
            f"r ∈ [{float(np.min(r)):g}, {float(np.max(r)):g}] with π ≤ 1, |A| ∈ {{{mags}}}")


def _side_pieces(ctx, res, adv):
    """The derived pieces of w for one sign of A (in t > 0, a = |A| > 0, μ > 0), or None where
    the weight is not derived or the arbiter does not confirm it."""
    if res["weight"] is None or res["arbiter"]["weight"]["status"] != "confirmed":
        return None
    # r < 1 is t < 1: t = 1/(1 + u) with u > 0 keeps that in SymPy's assumptions
    u = ctx.sp.Symbol("u", positive=True)
    return [e if c["_tmax"] is None else e.subs(ctx.t, 1 / (1 + u))
            for c in res["cases"] if c["advantage"] == adv for e, _ in c["_pieces"]]


def _pieces_sign(ctx, pieces):
    """+1 or −1 where SymPy shows every piece > 0 (or < 0) for all positive t (t < 1 where
    r < 1), a and μ, whatever its condition (a sufficient condition: the domain is smaller),
    0 where every piece is 0, else None."""
    if all(e == 0 for e in pieces):
        return 0
    sp = ctx.sp
    v = sp.Symbol("v", nonnegative=True)

    def one(e):
        """e's sign, or None: as it stands, else as one fraction with μ = 1/(1 + v) (μ ≤ 1,
        which SymPy's assumptions cannot hold) whose expanded numerator and denominator
        each have a sign (DRPO's 1 − 2μt/25 with t < 1 is (25uv + 25u + 25v + 23)/…)."""
        for s, test in ((1, lambda x: x.is_positive), (-1, lambda x: x.is_negative)):
            if test(e) is True:
                return s
        check_budget("tidy", size(e))
        num, den = (sp.expand(x) for x in sp.fraction(sp.together(e.subs(ctx.mu, 1 / (1 + v)))))
        signs = [1 if x.is_positive else -1 if x.is_negative else None for x in (num, den)]
        return None if None in signs else signs[0] * signs[1]

    def sign():
        found = {one(e) for e in pieces}
        return found.pop() if len(found) == 1 and None not in found else None
    return ctx.limited("the sign of w", sign, None)


def _absence(ctx, res, adv, grid, zero_everywhere) -> dict:
    """The claim for a sign of A with no boundary found: w ≡ 0 or no boundary, proven where
    SymPy gives every derived piece one sign and w(1) agrees (derived only here, where it can
    prove something: a degree-9 objective spent 1.4 s on it), else the grid's evidence."""
    pieces = _side_pieces(ctx, res, adv)
    sign = _pieces_sign(ctx, pieces) if pieces else None
    at_one = res["on_policy"][adv]
    one_ok = at_one["status"] != "undefined" and None not in at_one["w"] and (
        at_one["w"][0] > 0 if sign == 1 else at_one["w"][1] < 0 if sign == -1 else at_one["w"] == [0, 0])
    if sign == 0 and one_ok:
        return {"claim": "w ≡ 0", "status": "proven", "evidence": "every derived piece of w is 0"}
    if zero_everywhere:
        return {"claim": "w ≡ 0", "status": "unconfirmed", "evidence": f"w = 0 at all of {grid}"}
    if sign in (1, -1) and one_ok:
        return {"claim": "none", "status": "proven",
                "evidence": f"every derived piece of w is {'> 0' if sign > 0 else '< 0'} (SymPy), and so is w(1)"}
    return {"claim": "none", "status": "unconfirmed", "evidence": f"none found at {grid}"
            + (" nor on the symbolic zeros probed outside the domain" if res["weight"] is not None else "")}


def claims(ctx, arb, res, facts) -> dict:
    """Each claim's status and evidence: per sign of A, the boundary (or its absence) and
    each boundary's reachability; smooth; bounded."""
    grid = grid_evidence(arb)
    out = {"boundary": {}, "reachable": {}}
    for adv, _ in SIGNS:
        b, f = res["boundary"][adv], facts[adv]
        valid = arb.valid & ((arb.sign > 0) == (adv == "positive"))
        zero_everywhere = bool(valid.any()) and not arb.np.any(arb.W[valid] != 0)
        # w = 0 on a region: zeros with a zero neighbour along the row (an isolated 0 is a touch)
        z = valid & (arb.W == 0)
        zeros = int((z & (arb.np.pad(z[:, 1:], ((0, 0), (0, 1))) | arb.np.pad(z[:, :-1], ((0, 0), (1, 0))))).sum())
        if b["pi"] or b["numeric"]:
            claim = {"claim": "boundary", "status": "found" if any(b["reachable"]) or b["numeric"] else "unconfirmed",
                     "evidence": "w changes sign at the grid points located" if any(b["reachable"]) or b["numeric"]
                     else "w changes sign only on the symbolic zero's curve outside the domain (probed)"}
        else:
            claim = _absence(ctx, res, adv, grid, zero_everywhere)
        claim["touches"] = bool(f["touches"])
        claim["zero_share"] = zeros / max(1, int(valid.sum()))
        out["boundary"][adv] = claim
        reach = []
        for p, ok in zip(b["pi"], b["reachable"]):
            if ok:
                reach.append({"status": "found", "evidence": "met by w's sign changes on the grid"})
                continue
            proof = ctx.limited("the boundary lies outside the domain",
                                lambda: (p - 1).is_positive is True, False)
            reach.append({"status": "proven", "evidence": "π > 1 for every μ > 0 (SymPy)"} if proof else
                         {"status": "unconfirmed", "evidence": f"not met at {grid}; found only outside the domain"})
        out["reachable"][adv] = reach
    # every operation continuous in r where it stands (its row says; x^c only for c ≥ 0, ...) and
    # none that branches (min, max and clip are continuous, but their derivatives are not)
    continuous_ir = all(n.op not in OPS or (OPS[n.op].is_continuous(n) and not OPS[n.op].branching)
                        for n in ctx.dl.walk())
    continuous_ir &= not any(facts[adv]["poles"] or facts[adv]["undefined"] for adv, _ in SIGNS)
    if not res["smooth"]:
        out["smooth"] = {"status": "found", "evidence": "a jump or pole located by bisection on the grid"}
    elif continuous_ir:
        out["smooth"] = {"status": "proven", "evidence": "∂ℓ/∂r is built from continuous operations only "
                         "(no mask, clip, min, max, sign or division)"}
    else:
        out["smooth"] = {"status": "unconfirmed", "evidence": f"no jump or pole found at {grid}"}
    if res["bounded"] is None:
        out["bounded"] = {"status": "unconfirmed", "evidence": "w is not a finite double at any sampled point"}
    elif not res["bounded"]:
        out["bounded"] = {"status": "found", "evidence": "w grows toward a pole, an undefined edge or the domain's corners"}
    elif res["cases"] and res["arbiter"]["weight"]["status"] == "confirmed" and \
            all(e.is_number and e.is_finite for c in res["cases"] for e, _ in c["_pieces"]):
        out["bounded"] = {"status": "proven", "evidence": "every derived piece of w is a constant"}
    else:
        out["bounded"] = {"status": "unconfirmed", "evidence": f"the extremes of {grid}, refined between them, "
                          "and the corners μ, r → 0, π → 1"}
    return out
