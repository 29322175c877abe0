"""What each claim of the analysis rests on.

A claim of absence or a global property ("no boundary", "unreachable", "bounded", "smooth")
is "proven" only from the derived weight (SymPy, confirmed by the arbiter); the grid alone
is evidence, so such a claim is "unconfirmed" and carries where it was looked for. A claim
of existence (a boundary met, a jump, a pole) rests on the points found: "found"."""
from __future__ import annotations

from dsl.operations import OPS
from openrlhf_drpo.analysis.symbolic.derivation import SIGNS
from openrlhf_drpo.analysis.symbolic.zeros import fixed_sign


def grid_evidence(arb) -> str:
    np = arb.np
    r = arb.R[arb.inside]
    mags = ", ".join(dict.fromkeys(f"{m:g}" for m in arb.magnitudes))     # 2 ± 2e-6 read 2, once
    return (f"{int(arb.inside.sum()):,} grid points, μ ∈ [{float(arb.mu.min()):g}, {float(arb.mu.max()):g}], "
            f"r ∈ [{float(np.min(r)):g}, {float(np.max(r)):g}] with π ≤ 1, |A| ∈ {{{mags}}}")


def _side_pieces(ctx, res, adv):
    """The derived pieces of w for one sign of A (in t > 0, a = |A| > 0, μ > 0), each with
    whether t < 1 there (r < 1), or None where the weight is not derived or the arbiter does
    not confirm it."""
    if res["weight"] is None or res["arbiter"]["weight"]["status"] != "confirmed":
        return None
    return [(e, c["_tmax"] is not None) for c in res["cases"] if c["advantage"] == adv for e, _ in c["_pieces"]]


def side_sign(ctx, res, adv):
    """+1 or −1 where SymPy shows every derived piece of w for this sign of A > 0 (or < 0)
    for all positive t (t < 1 where r < 1), a and μ, whatever its condition (a sufficient
    condition: the domain is smaller), 0 where every piece is 0, else None."""
    pieces = _side_pieces(ctx, res, adv)
    if not pieces:
        return None
    if all(e == 0 for e, _ in pieces):
        return 0

    def sign():
        found = {fixed_sign(ctx, e, bounded) for e, bounded in pieces}
        return found.pop() if len(found) == 1 and None not in found else None
    return ctx.limited("the sign of w", sign, None)


def _absence(ctx, res, adv, grid, zero_everywhere, sign) -> dict:
    """The claim for a sign of A with no boundary found: w ≡ 0 or no boundary, proven where
    SymPy gives every derived piece one sign and w(1) agrees (derived only here, where it can
    prove something: a degree-9 objective spent 1.4 s on it), else the grid's evidence."""
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


def _rounded(ctx, arb, z, adv, sign):
    """The grid's zeros of w that are the doubles' rounding, not zeros of w: all of them where
    the derived w is shown nonzero (sign ±1), else those where extended precision (numpy's
    long double) gives a tiny w ≠ 0 (an underflow, e^(−800)). A note says where the compiled
    loss then gives no gradient all the same."""
    np = arb.np
    out = np.zeros_like(z)
    if not z.any():
        return out
    if sign in (1, -1):
        out = z.copy()
        why = f"the derived w is {'> 0' if sign > 0 else '< 0'} there (SymPy)"
    else:
        mu, A, scale = (np.broadcast_to(x, z.shape)[z] for x in (arb.mu, arb.sign * arb.mag, arb.row_scale))
        with np.errstate(all="ignore"):
            wide = arb.w(arb.R[z].astype(np.longdouble), mu, A, dtype=np.longdouble)
        # tiny there, not an ordinary value (a threshold that long double rounds to its other side)
        out[z] = np.isfinite(wide) & (wide != 0) & (np.abs(wide) < 1e-12 * scale)
        why = "extended precision gives w ≠ 0 there"
    if out.any():
        share = out.sum() / max(1, int((arb.valid & ((arb.sign > 0) == (adv == "positive"))).sum()))
        r = arb.R[out]
        ctx.note(f"for A {'>' if adv == 'positive' else '<'} 0, w rounds to 0 in doubles at {100 * share:.3g}% of the grid points "
                 f"(r from {float(r.min()):.6g} to {float(r.max()):.6g}): an underflow or a cancellation, not a zero of w, "
                 f"since {why}; the compiled loss gives those tokens no gradient")
    return out


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
        sign = None
        if b["pi"] or b["numeric"]:
            claim = {"claim": "boundary", "status": "found" if any(b["reachable"]) or b["numeric"] else "unconfirmed",
                     "evidence": "w changes sign at the grid points located" if any(b["reachable"]) or b["numeric"]
                     else "w changes sign only on the symbolic zero's curve outside the domain (probed)"}
        else:
            sign = side_sign(ctx, res, adv)
            claim = _absence(ctx, res, adv, grid, zero_everywhere, sign)
        z = valid & (arb.W == 0)
        region = z & (arb.np.pad(z[:, 1:], ((0, 0), (0, 1))) | arb.np.pad(z[:, :-1], ((0, 0), (1, 0))))
        zeros = int((region & ~_rounded(ctx, arb, region, adv, sign)).sum())
        claim["touches"] = bool(f["touches"])
        claim["zero_share"] = zeros / max(1, int(valid.sum()))
        out["boundary"][adv] = claim
        reach = []
        for p, ok in zip(b["pi"], b["reachable"]):
            if ok:
                reach.append({"status": "found", "evidence": "met by w's sign changes on the grid"})
                continue
            proof = ctx.limited("the boundary lies outside the domain",
                                lambda: "π > 1" if (p - 1).is_positive is True else
                                "π ≥ 1, the domain's edge or beyond," if (p - 1).is_nonnegative is True else None, None)
            reach.append({"status": "proven", "evidence": f"{proof} for every μ > 0 (SymPy)"} if proof else
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
