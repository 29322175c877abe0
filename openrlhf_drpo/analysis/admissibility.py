"""Admissibility: the properties the 2026 gate papers derive by hand for each new gate
(smooth-gate, DGPO, REAL): w(1) = 1, boundedness, the two tails of w and its symmetry in
log r, each with how it is known: 'derived' (SymPy, confirmed by the IR's float rules) or
'numeric' (the IR's float rules alone, on the samples stated)."""
from __future__ import annotations

import math

from openrlhf_drpo.analysis.numeric.arbiter import MUS
from openrlhf_drpo.analysis.budgets import check_budget, size
from openrlhf_drpo.analysis.numeric.events import UNDERFLOW
from openrlhf_drpo.analysis.symbolic.derivation import SIGNS

TAIL_R = (1e-12, 1e12, 221)     # log-spaced: r → 0 at fixed μ; r → 1/μ along π = 1 as μ → 0
SYMMETRY_T = 400                # values of t = log r per μ for w(e^t) = w(e^−t)


def admissibility(ctx, arb, res, tail_facts) -> dict:
    """Each property with how it is known: 'derived' (SymPy, confirmed by the IR's float
    rules) or 'numeric' (the IR's float rules alone, on the samples stated); the tails are
    tails(arb), found before the range, which closes over their limits (limits)."""
    # bounded is the range's claim (claims.bounded): "yes" only as sure as the range it rests on
    return {"w_at_1": _w_at_1(ctx, res), "bounded": {"value": res["bounded"], "range": res["weight_range"],
                                                       "status": res["claims"]["bounded"]["status"]},
            "tails": tail_facts, "symmetric_log_r": _symmetric(ctx, arb, res)}


def limits(tail_facts) -> list:
    """The values w tends to at the domain's corners that the tails show and a sample there
    does not reach: 0 where w decays (r^0.3 is 3e-5 at r = 1e-15, and 0 in the limit). The
    range is the closure of w's values, so it holds them; the same rule as the tails' own."""
    kinds = set()
    for side in tail_facts["by_sign"].values():
        for found in side.values():
            kinds |= set(found.get("kinds", [found["kind"]]))
    return [0.0] if kinds & {"decays polynomially", "decays exponentially"} else []


def _derived_weight(ctx, res, sign):
    """The derived one-line w at parameter values with A = sign·a, or None."""
    if res["weight"] is None or res["arbiter"]["weight"]["status"] != "confirmed":
        return None
    values = {ctx.param_syms[k]: v for k, v in ctx.param_vals.items()}
    return res["weight"].subs(values).subs(ctx.A, sign * ctx.a)


def _w_at_1(ctx, res) -> dict:
    facts = res["on_policy"]
    numeric = all(f["status"] == "ok" and abs(f["w"][0] - 1) <= 1e-9 and abs(f["w"][1] - 1) <= 1e-9
                  for f in facts.values())

    def derived():
        for sign in (1, -1):
            w = _derived_weight(ctx, res, sign)
            if w is None:
                return False
            at_1 = w.subs(ctx.r, 1)
            check_budget("simplify", size(at_1))
            if ctx.sp.simplify(at_1) != 1:
                return False
        return True
    proven = numeric and ctx.guarded("w at r = 1", derived, False)
    return {"value": numeric, "status": "derived" if proven else "numeric",
            "w": {adv: f["w"] for adv, f in facts.items()}}


def tails(arb) -> dict:
    """Per sign of A, how w behaves as r → 0 (at each μ of the arbiter's MUS) and as r → 1/μ
    with π = 1 and μ → 0 (r → ∞), at each |A| the arbiter samples: classified from log|w|
    against log r along TAIL_R (numeric, the IR's float rules)."""
    import numpy as np
    rs = np.geomspace(*TAIL_R)
    lower, upper = rs[rs < 0.1][::-1], rs[rs > 10]
    out = {}
    for adv, sign in SIGNS:
        found = {"zero": [], "infinity": []}
        for mag in arb.magnitudes:
            A = sign * mag
            for mu in MUS:
                at = (lambda x, dtype, mu=mu, A=A: arb.w(x, mu, A, dtype=dtype))
                found["zero"].append(_classify(lower, arb.w(lower, mu, A), at))
            at = (lambda x, dtype, A=A: arb.w(x, 1 / np.asarray(x, dtype=dtype), A, dtype=dtype))
            found["infinity"].append(_classify(upper, arb.w(upper, 1 / upper, A), at))
        out[adv] = {k: _merge_tails(v) for k, v in found.items()}
    return {"by_sign": out, "status": "numeric",
            "samples": {"r": list(TAIL_R), "mu": list(MUS), "magnitudes": list(arb.magnitudes)}}


def _classify(x, w, at=None) -> dict:
    """x runs toward the limit (0 or ∞). The local slope of log|w| against log x says how
    w goes: ~0 with w settling (a constant), a steady −p (polynomial decay of order p), ever
    steeper (exponential). Values below UNDERFLOW that end in exact zeros or change sign are
    a decay that underflowed (the rule the range and the boundaries use too); exact zeros
    after ordinary values are a cut, unless extended precision (at(x, np.longdouble): w along
    the path) is not 0 where they begin: a cancellation, and the decay before it decides."""
    import numpy as np
    finite = np.isfinite(w)
    u = np.abs(np.log(x))       # grows toward the limit
    if not finite[-5:].all():
        if finite.any():
            k = np.nonzero(finite)[0][-1]
            if k > 5 and abs(w[k]) > 1e3 * max(1.0, abs(w[0])):
                return {"kind": "grows", "order": None, "sign": int(np.sign(w[k])), "past": float(x[k])}
        return {"kind": "undefined"}
    small = np.abs(w) < UNDERFLOW
    start = len(w) - (np.argmin(small[::-1]) if not small.all() else len(w))    # the final run of |w| < UNDERFLOW
    run = w[start:]
    if run.size and ((run == 0).any() or len(set(np.sign(run[run != 0]))) > 1):
        nz = np.nonzero(w != 0)[0]
        if nz.size and abs(w[nz[-1]]) < UNDERFLOW:
            return {"kind": "decays exponentially", "order": None, "underflows": float(x[nz[-1]])}
        cancelled = _cancelled(x, start, at) if at is not None and (run == 0).all() and start > 0 else None
        if cancelled is not None:
            return cancelled
        if (run == 0).all() and run.size >= 5:
            return {"kind": "is 0 (cut off)", "order": None}
    tail = slice(len(x) - 30, len(x))       # the last ~1.5 decades of r
    with np.errstate(divide="ignore", invalid="ignore"):     # a 0 in w: −inf, and a nan slope (changes sign)
        lw = np.log(np.abs(w))
        slope = np.diff(lw[tail]) / np.diff(u[tail])
    end = float(w[-1])
    if not np.isfinite(slope).all() or len(set(np.sign(w[tail]))) > 1:
        return {"kind": "changes sign", "order": None}
    if np.abs(slope).max() < 1e-3:
        return {"kind": "tends to a constant", "value": end}
    if abs(slope[-1]) > 5 and abs(slope[-1]) > 3 * abs(slope[0]):      # ever steeper: e^(∓c·r) or e^(∓c/r)
        return {"kind": "decays exponentially" if slope[-1] < 0 else "grows", "order": None,
                "sign": int(np.sign(end)), **({} if slope[-1] < 0 else {"note": "faster than any power"})}
    p = -float(slope[-5:].mean())
    if abs(p) < 0.05:
        return {"kind": "tends to a constant", "value": end, "note": "slowly (a logarithmic factor)"}
    return {"kind": "decays polynomially" if p > 0 else "grows", "order": round(abs(p), 2),
            "sign": int(np.sign(end)), "steady": bool(np.ptp(slope) <= 0.05 * max(1.0, abs(p)))}


def _cancelled(x, start, at):
    """Where w's exact zeros from x[start] on begin, in doubles (at(x, dtype) is w along the
    path), at a place where extended precision gives w ≠ 0, they are a cancellation (1 − σ read
    as 0 past r ≈ 38 in SAPO's weight written out), not a cut: the decay up to that place is
    classified instead, on 48 points over the 1.5 decades before it in long double. None where
    the zeros are w's own."""
    import numpy as np
    lo, hi = float(x[start - 1]), float(x[start])      # w ≠ 0 at lo, 0 at hi
    for _ in range(60):     # the first 0, to a double's resolution
        mid = np.sqrt(lo * hi)
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if float(at(np.array([mid]), float)[0]) == 0 else (mid, hi)
    with np.errstate(all="ignore"):
        first = float(at(np.array([hi]), np.longdouble)[0])
    if not np.isfinite(first) or first == 0:
        return None
    away = hi * 10 ** 1.5 if x[0] > x[-1] else hi / 10 ** 1.5
    dense = np.geomspace(away, lo, 48)
    with np.errstate(all="ignore"):
        found = _classify(dense, np.asarray(at(dense, np.longdouble), dtype=float))
    return {**found, "rounds": lo}


def _merge_tails(found) -> dict:
    """One description over μ and |A|: a shared kind, with the span of its order or limit."""
    kinds = sorted({f["kind"] for f in found})
    if len(kinds) > 1:
        return {"kind": "varies", "kinds": kinds}
    out = {"kind": kinds[0]}
    if kinds[0] == "tends to a constant":
        vals = [f["value"] for f in found]
        out["value"] = [min(vals), max(vals)]
    orders = [f["order"] for f in found if f.get("order") is not None]
    if orders:
        out["order"] = [min(orders), max(orders)]
        out["steady"] = all(f.get("steady", True) for f in found)
    signs = {f.get("sign") for f in found if f.get("sign")}
    out["sign"] = signs.pop() if len(signs) == 1 else None
    notes = sorted({f["note"] for f in found if f.get("note")})
    # where a double gives out first along the path: w overflows (ℓ with it) or underflows to 0
    for key, text in (("past", "not a finite double past r ≈ {:.3g}"), ("underflows", "underflows to 0 past r ≈ {:.3g}"),
                      ("rounds", "rounds to 0 in doubles past r ≈ {:.3g}")):
        xs = [f[key] for f in found if key in f]
        if xs:
            notes.append(text.format(min(xs, key=lambda x: abs(math.log(x)))))
    out["note"] = "; ".join(notes) if notes else None
    return out


def _threshold_ts(arb, t, mu, A):
    """|log r| on both sides of every threshold of the objective at μ (in r, in π, and the
    quantities read per row, π − μ), inside the domain: a band that lies on one side of r = 1
    only (a notch 1e-4 wide at r ≈ 1.1) falls between the 400 values of t, and is asymmetric."""
    np = arb.np
    rs = np.concatenate([np.exp(-t[::-1]), np.exp(t)])
    found = np.concatenate([arb.found["r"], arb.found["pi"] / mu,
                            arb.row_thresholds(rs[None, :], np.array([mu]), np.array([A]), arb.row_quantities)[0]])
    found = found[np.isfinite(found) & (found > mu) & (found < 1 / mu)]
    return np.unique(np.abs(np.log(found[found != 1])))


def _symmetric(ctx, arb, res) -> dict:
    """w(e^t) = w(e^−t) for each sign of A, wherever both ratios lie in the domain (e^t ≤ 1/μ),
    on the arbiter's μ and |A|; derived as well where SymPy reduces the difference of the
    one-line w to 0."""
    import numpy as np
    by = {}
    for adv, sign in SIGNS:
        worst, gap = None, 0.0
        # the regular values of t first, then (where they show no asymmetry) both sides of
        # each threshold: the example stays the largest difference on the regular ones
        for extra in (False, True):
            if worst is not None:
                break
            for mu in MUS[:-1]:           # at μ = 1 no r > 1 is in the domain
                regular = np.linspace(0, -np.log(mu), SYMMETRY_T + 1)[1:]
                for mag in arb.magnitudes:
                    t = _threshold_ts(arb, regular, mu, sign * mag) if extra else regular
                    a, b = arb.w(np.exp(t), mu, sign * mag), arb.w(np.exp(-t), mu, sign * mag)
                    with np.errstate(invalid="ignore"):
                        rel = np.abs(a - b) / np.fmax(1.0, np.fmax(np.abs(a), np.abs(b)))
                    rel = np.where(np.isnan(a) != np.isnan(b), np.inf, np.nan_to_num(rel, nan=0.0))
                    k = int(np.argmax(rel)) if rel.size else 0
                    if rel.size and rel[k] > max(gap, 1e-6):       # the example is the largest difference
                        gap = float(rel[k])
                        worst = {"mu": float(mu), "A": float(sign * mag), "r": float(np.exp(t[k])),
                                 "w": [None if np.isnan(x) else float(x) for x in (a[k], b[k])]}   # None: undefined
        by[adv] = {"value": worst is None, "example": worst}

    def derived():
        for sign in (1, -1):
            w = _derived_weight(ctx, res, sign)
            if w is None or w.has(ctx.sp.Piecewise):
                return False
            x = ctx.sp.Symbol("x", real=True)
            gap = w.subs(ctx.r, ctx.sp.exp(x)) - w.subs(ctx.r, ctx.sp.exp(-x))
            check_budget("simplify", size(gap))
            if ctx.sp.simplify(gap) != 0:
                return False
        return True
    value = all(b["value"] for b in by.values())
    proven = value and ctx.guarded("symmetry in log r", derived, False)
    return {"value": value, "by_sign": by, "status": "derived" if proven else "numeric"}
