"""Where one case's weight is 0 for t > 0: each piece's zeros inside its condition, in closed
form where the numerator's factors allow (within the work budgets), else left implicit for the
arbiter to locate; and the edges where a piece ends (where w may jump to 0)."""
from __future__ import annotations

from openrlhf_drpo.analysis.budgets import OverBudget, check_budget, size
from openrlhf_drpo.analysis.symbolic.context import degree
from openrlhf_drpo.analysis.symbolic.intervals import relations


def zeros(ctx, pieces, tmax):
    """Where w = 0 for t > 0: a piece's zeros inside its condition, or the edges where w
    jumps to 0. Returns (t*, condition) or ("implicit", h) for an edge h(t, μ) = 0 that
    SymPy cannot solve in closed form."""
    sp, t = ctx.sp, ctx.t
    out = []
    for i, (expr, cond) in enumerate(pieces):
        if expr == 0:
            if cond == sp.true and i == 0:       # w ≡ 0 on this whole side: the boundary is r = 1
                out.append((sp.Integer(0), sp.true))
            eff = _effective(ctx, pieces, i)
            out += [(c, sp.true) for c in thresholds(ctx, eff)]
            out += [("implicit", rel.lhs - rel.rhs, sp.true) for rel in relations(sp, eff)
                    if t in rel.free_symbols and not _is_threshold(ctx, rel)]
            continue
        if t not in expr.free_symbols:
            continue
        while isinstance(expr, sp.sign) or (expr.is_Mul and any(isinstance(f, sp.sign) for f in expr.args)
                                            and len(expr.args) == 2 and expr.args[0].is_number):
            expr = expr.args[-1] if expr.is_Mul else expr.args[0]      # c·sign(f) = 0 where f = 0
        if not expr.is_rational_function(t):   # transcendental: an implicit boundary, found numerically
            if _nonzero(ctx, expr, tmax) is None:
                out.append(("implicit", expr, cond))
            continue
        sols = ctx.limited("solving w = 0", lambda: _solve_rational(ctx, expr, t), None)
        if sols is None:
            out.append(("implicit", expr, cond))
            continue
        for sol in sols or []:
            if sol.is_real is False or sol.is_nonpositive or (tmax is not None and (sol - tmax).is_nonnegative):
                continue
            out.append((sp.cancel(sol), cond))
    return out


def _nonzero(ctx, expr, tmax):
    """expr's sign where SymPy shows it never 0 (SAPO's weight written out, whose doubles
    cancel to 0 past r ≈ 38, is 4e^x/(1 + e^x)² > 0): then it has no zero to find; else None."""
    try:
        return fixed_sign(ctx, expr, bounded_t=tmax is not None)
    except OverBudget:
        return None
    except Exception:       # noqa: BLE001 - SymPy raises many types: no proof, the zero stays a candidate
        return None


def _solve_rational(ctx, expr, t):
    """Zeros in t of a rational function: its numerator's factors' roots, in closed form.
    (sp.solve gives the same, but its first call imports the solvers package, ~0.9 s.) Within
    budgets: the expression's size, then each factor's degree ((1 + t)^127 is degree 1)."""
    sp = ctx.sp
    check_budget("solve", size(expr))
    num, den = sp.fraction(sp.together(expr))
    roots = []
    for factor in sp.Mul.make_args(num):
        base = factor.base if factor.is_Pow and factor.exp.is_Integer and factor.exp > 0 else factor
        if t not in base.free_symbols:
            continue
        check_budget("roots", degree(sp, base))
        roots += [x for x in _roots(sp, sp.Poly(base, t)) if x not in roots]
    return [x for x in roots if den.subs(t, x) != 0]


def _roots(sp, poly) -> list:
    coeffs = poly.all_coeffs()
    if poly.degree() == 1:
        return [-coeffs[1] / coeffs[0]]
    if poly.degree() == 2:
        a2, b, c = coeffs
        disc = sp.sqrt(b * b - 4 * a2 * c)
        return [(-b + disc) / (2 * a2), (-b - disc) / (2 * a2)]
    if poly.degree() <= 0:
        return []
    found = sp.roots(poly)
    if sum(found.values()) != poly.degree():
        raise NotImplementedError("roots not in closed form")
    return list(found)


def _effective(ctx, pieces, i):
    sp = ctx.sp
    prev = [sp.Not(c) for _, c in pieces[:i]]
    return sp.And(*prev, pieces[i][1]) if prev else pieces[i][1]


def _is_threshold(ctx, rel) -> bool:
    return rel.lhs == ctx.t and ctx.t not in rel.rhs.free_symbols


def thresholds(ctx, cond) -> list:
    """Every c of a settled relation t ⋚ c inside a condition."""
    return [rel.rhs for rel in relations(ctx.sp, cond) if _is_threshold(ctx, rel)]


def edges(ctx, pieces):
    out = []
    for _, cond in pieces:
        out += [c for c in thresholds(ctx, cond) if c not in out]
    return out


def fixed_sign(ctx, e, bounded_t=False):
    """+1 or −1 where SymPy shows e > 0 (or < 0) for all t > 0 (0 < t < 1 with bounded_t: r < 1),
    a = |A| > 0 and 0 < μ ≤ 1, else None: as it stands, or as one fraction with μ = 1/(1 + v)
    (μ ≤ 1, which SymPy's assumptions cannot hold) and t = 1/(1 + u) for bounded_t, whose
    expanded numerator and denominator each have a sign (DRPO's 1 − 2μt/25 with t < 1 is
    (25uv + 25u + 25v + 23)/…; SAPO's weight written out, 4/(1 + e^x) − 4/(1 + e^x)², is
    4e^x/(1 + e^x)²). A sum of terms of one sign is what the doubles cannot round to 0 by
    cancellation. Past the tidy budget, OverBudget (the caller's fallback: not shown)."""
    sp = ctx.sp
    u, v = sp.Symbol("u", positive=True), sp.Symbol("v", nonnegative=True)
    if bounded_t:
        e = e.subs(ctx.t, 1 / (1 + u))
    for s, test in ((1, lambda x: x.is_positive), (-1, lambda x: x.is_negative)):
        if test(e) is True:
            return s
    check_budget("tidy", size(e))
    num, den = (sp.expand(x) for x in sp.fraction(sp.together(e.subs(ctx.mu, 1 / (1 + v)))))
    signs = [1 if x.is_positive else -1 if x.is_negative else None for x in (num, den)]
    return None if None in signs else signs[0] * signs[1]
