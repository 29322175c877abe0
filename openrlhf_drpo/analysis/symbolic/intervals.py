"""Settling a condition by tabulation: a condition whose relations compare one variable (t,
|A| = a or μ) with numbers, or t with thresholds c(μ) that keep one order, is constant between
its thresholds, so it is evaluated there and rebuilt as the shortest union of intervals (SymPy's
as_set does the same job about a hundred times slower). The hook that settles every condition
as it is built is analysis.symbolic.settling's."""
from __future__ import annotations

import math
from dataclasses import dataclass

from openrlhf_drpo.analysis.numeric.sampling import numpy_fn

BUDGET_CELLS = 400     # cells a condition is tabulated on (settle_cells); past it, kept as built


@dataclass(frozen=True)
class Domain:
    """One case's variables: t > 0 (below tmax where r < 1), a = |A| > 0 and 0 < μ ≤ 1."""
    sp: object
    t: object
    mu: object
    a: object
    tmax: object


def settle_condition(dom, out):
    """A condition of settled relations (t ⋚ c, μ ⋚ m, a ⋚ b) as the shortest equivalent: in
    cells of a and μ, in μ alone, in t alone, along t with thresholds c(μ), or one threshold."""
    sp = dom.sp
    if out in (sp.true, sp.false):
        return out
    if dom.a in out.free_symbols or len(out.free_symbols & {dom.t, dom.mu}) > 1:
        settled = settle_cells(dom, out)
        if settled is not None:
            return settled
    if out.free_symbols == {dom.mu}:
        return settle(dom, out, dom.mu)
    if dom.t not in out.free_symbols:
        return out
    if out.free_symbols == {dom.t}:
        return settle(dom, out)
    settled = settle_mu(dom, out)
    return settle_one(dom, out) if settled is None else settled


def linear_in_t(dom, func, h):
    """h ⋚ 0 as t ⋚ c where h is linear in t with a coefficient of known sign, else as it is."""
    sp, t = dom.sp, dom.t
    poly = h.as_poly(t)
    if poly is None or poly.degree() != 1:
        return func(h, 0)
    c1, c0 = poly.all_coeffs()
    func_ = func if c1.is_positive else flipped(sp, func) if c1.is_negative else None
    if func_ is None:
        return func(h, 0)
    c = sp.cancel(-c0 / c1)
    return func_(t, sp.expand(c) if c.has(sp.exp) else c)      # (e^0.4 − 1)·e^-0.4 is 1 − e^-0.4


def settle_one(dom, cond):
    """A condition whose relations all compare t with one expression c(μ): its truth
    depends only on t < c, t = c or t > c, so it is one of t ≤ c, t < c, t ≥ c, t > c,
    t = c, t ≠ c, true or false (μ-dependent clips print as a person would write them)."""
    sp, t = dom.sp, dom.t
    rels = cond.atoms(sp.core.relational.Relational)
    sides = {rel.rhs for rel in rels}
    if any(rel.lhs != t for rel in rels) or len(sides) != 1:
        return cond
    c = sides.pop()
    e = sp.Dummy("e", positive=True)
    truth = [cond.xreplace({t: x}) for x in (c - e, c, c + e)]
    if any(v not in (sp.true, sp.false) for v in truth):
        return cond
    forms = {(1, 1, 1): sp.true, (0, 0, 0): sp.false, (1, 1, 0): sp.Le(t, c), (1, 0, 0): sp.Lt(t, c),
             (0, 1, 1): sp.Ge(t, c), (0, 0, 1): sp.Gt(t, c), (0, 1, 0): sp.Eq(t, c), (1, 0, 1): sp.Ne(t, c)}
    return forms[tuple(int(v == sp.true) for v in truth)]


def settle(dom, cond, x=None, exact=None):
    """A condition in one variable x (t, |A| = a or μ) is constant between its thresholds:
    evaluate it at each threshold and between them, then rebuild the shortest equivalent,
    a union of intervals (t ≤ c, c < t ≤ d, ...). exact maps a threshold's float to the
    expression printed for it. (SymPy's as_set does the same job about a hundred times slower.)"""
    sp = dom.sp
    x = dom.t if x is None else x
    rels = relations(sp, cond)
    if any(rel.lhs != x or not rel.rhs.is_number for rel in rels):
        return cond
    # thresholds are told apart as doubles: two that are one double, or one that is an end of
    # x's range as a double only (r > 1e-20 is t < 1 − 1e-20, which reads t < 1: always), keep
    # the condition as built rather than drop a band's edge
    ends = [sp.Integer(0)] + ([dom.tmax] if x == dom.t and dom.tmax is not None else [sp.Integer(1)] * (x == dom.mu))
    by_float = {}
    for c in {rel.rhs for rel in rels} | set(ends):
        by_float.setdefault(float(c), set()).add(c)
    if any(len(cs) > 1 for cs in by_float.values()):
        return cond
    exact = {**{float(rel.rhs): rel.rhs for rel in rels}, **(exact or {})}
    cuts, probes = probe_points(dom, x, {float(rel.rhs) for rel in rels})
    return intervals(sp, x, cuts, exact, list(truth_at(sp, [x], cond, [probes])))


def probe_points(dom, x, cuts):
    """The thresholds inside x's range, ascending, and the points that tell every cell
    apart: even index inside an interval, odd index a threshold itself. t ranges over
    (0, tmax), a over (0, ∞), μ over (0, 1] (μ = 1 is in the domain; t = tmax, π = 0, is not)."""
    closed = x == dom.mu
    hi = 1.0 if closed else float(dom.tmax) if x == dom.t and dom.tmax is not None else math.inf
    cuts = sorted(c for c in cuts if 0 < c < hi or (closed and c == hi))
    edges = [0.0] + cuts + ([] if closed and cuts and cuts[-1] == hi else [hi])
    probes = []
    for i in range(len(edges) - 1):
        a, b = edges[i], edges[i + 1]
        probes.append((a + b) / 2 if math.isfinite(b) else a + 1.0)
        if i < len(cuts):
            probes.append(cuts[i])
    return cuts, probes


def intervals(sp, x, cuts, exact, truth):
    """The union of intervals of x where truth (over probe_points' points) holds."""
    if all(truth):
        return sp.true
    if not any(truth):
        return sp.false
    runs, k = [], 0
    while k < len(truth):
        if not truth[k]:
            k += 1
            continue
        j = k
        while j + 1 < len(truth) and truth[j + 1]:
            j += 1
        runs.append((k, j))
        k = j + 1
    out = []
    for k, j in runs:
        parts = []
        if k > 0:       # the run's lower end: a threshold, itself in the run when k is odd
            c = exact[cuts[(k - 1) // 2]] if k % 2 else exact[cuts[k // 2 - 1]]
            parts.append(sp.Ge(x, c) if k % 2 else sp.Gt(x, c))
        if j < len(truth) - 1:
            c = exact[cuts[j // 2]]
            parts.append(sp.Le(x, c) if j % 2 else sp.Lt(x, c))
        if k == j and k % 2:
            parts = [sp.Eq(x, exact[cuts[k // 2]])]
        out.append(sp.And(*parts))
    return sp.Or(*out)


def settle_cells(dom, cond):
    """A condition whose relations each compare one of t, |A| = a or μ with a number is
    constant on the cells between those numbers, so it is tabulated there and rebuilt:
    an empty region becomes false; in two variables it reads as intervals of the outer
    one (|A| or μ), each with its condition in r: (2 ≤ |A| ≤ 20 and r ≤ 1.2) or |A| > 20
    or |A| < 2. Else None (kept as built)."""
    import itertools
    sp = dom.sp
    swap, exact = {}, {}
    for rel in relations(sp, cond):
        h = sp.expand(rel.lhs - rel.rhs)
        if len(h.free_symbols) != 1 or not h.free_symbols <= {dom.t, dom.a, dom.mu}:
            return None
        (x,) = h.free_symbols
        if (line := linear(h, x)) is None:
            return None
        c1, c0 = line
        swap[rel] = (rel.func if c1 > 0 else flipped(sp, rel.func))(x, -c0 / c1)
        exact.setdefault(x, {})[float(-c0 / c1)] = -c0 / c1
    cond = cond.xreplace(swap)
    xs = sorted(exact, key=lambda x: x != dom.t)      # t first: the inner variable
    axes = [probe_points(dom, x, set(exact[x])) for x in xs]
    if math.prod(len(p) for _, p in axes) > BUDGET_CELLS:
        return None
    points = list(zip(*itertools.product(*(p for _, p in axes))))
    truth = truth_at(sp, xs, cond, points).reshape([len(p) for _, p in axes])
    matters = [k for k in range(len(xs)) if (truth != truth.take([0], axis=k)).any()]
    if len(matters) > 2:
        return None
    # the variables that matter first (inner, then outer), the others at any value
    table = truth.transpose(matters + [k for k in range(len(xs)) if k not in matters])
    table = table.reshape([truth.shape[k] for k in matters] + [-1])[..., 0]
    if len(matters) < 2:
        return sp.false if not truth.any() else sp.true if truth.all() else \
            intervals(sp, xs[matters[0]], axes[matters[0]][0], exact[xs[matters[0]]], list(table))
    inner, outer = matters
    out, seen = [], []
    for row in table.T:        # one pattern in the inner variable per cell of the outer one
        if any((row == s).all() for s in seen):
            continue
        seen.append(row)
        where = [bool((other == row).all()) for other in table.T]
        out.append(sp.And(intervals(sp, xs[outer], axes[outer][0], exact[xs[outer]], where),
                          intervals(sp, xs[inner], axes[inner][0], exact[xs[inner]], list(row))))
    return sp.Or(*out)


def settle_mu(dom, cond):
    """A condition whose relations compare t with thresholds c(μ) that keep one order
    over 0 < μ ≤ 1 (and against t's own range): its truth pattern along t is the same at
    every μ, so it is settled at μ = 1/2 and the thresholds written back. Empty regions
    (t ≥ 2 and t ≤ μ) become false. The order is decided exactly (see fixed_sign)."""
    sp, t, mu = dom.sp, dom.t, dom.mu
    rels = relations(sp, cond)
    if any(rel.lhs != t or not rel.rhs.free_symbols <= {mu} for rel in rels):
        return None
    cs = sorted({rel.rhs for rel in rels}, key=sp.default_sort_key)
    ends = [sp.Integer(0)] + ([dom.tmax] if dom.tmax is not None else [])
    for i, c in enumerate(cs):
        for d in cs[i + 1:] + [e for e in ends if c.free_symbols]:
            if fixed_sign(sp, mu, c - d) is None:
                return None
    half = sp.Rational(1, 2)
    at = {float(c.xreplace({mu: half})): c for c in cs}
    if len(at) != len(cs):
        return None
    return settle(dom, cond.xreplace({mu: half}), exact=at) if at else None


def in_mu(dom, func, h):
    """h ⋚ 0 without t, as μ ⋚ m where it is linear in μ or 1/μ (a = |A| > 0 and μ > 0
    divided out): 1/μ ≥ 10 reads μ ≤ 0.1, a·μ − 2a ≥ 0 reads μ ≥ 2 (false in the domain)."""
    sp, mu, a = dom.sp, dom.mu, dom.a
    if a in h.free_symbols:
        q = sp.cancel(h / a)
        h = q if a not in q.free_symbols else h
    if h.free_symbols == {mu}:
        for g in (h, sp.expand(h * mu)):
            if (line := linear(g, mu)) is not None:
                c1, c0 = line
                return (func if c1.is_positive else flipped(sp, func))(mu, -c0 / c1)
    return func(h, 0)


def flipped(sp, func):
    """The relation that holds once both sides are multiplied by a negative number."""
    return {sp.Lt: sp.Gt, sp.Le: sp.Ge, sp.Gt: sp.Lt, sp.Ge: sp.Le}.get(func, func)


def linear(g, x):
    """(c1, c0) where g = c1·x + c0 with numbers c1 ≠ 0 and c0, else None."""
    poly = g.as_poly(x)
    if poly is None or poly.degree() != 1 or not all(c.is_number for c in poly.all_coeffs()):
        return None
    return tuple(poly.all_coeffs())


def fixed_sign(sp, mu, d):
    """+1 or −1 when d(μ) keeps that sign over 0 < μ ≤ 1, decided exactly for d linear in μ
    or in 1/μ (monotone, so its two ends decide), else None."""
    d = sp.expand(d)
    if d.is_number:
        return None if d == 0 else (1 if d > 0 else -1)
    nu = sp.Dummy("nu", positive=True)
    for g, var, ends in ((d, mu, (0, 1)), (sp.expand(d.xreplace({mu: 1 / nu})), nu, (1, None))):
        if (line := linear(g, var)) is None:
            continue
        c1, c0 = line
        near = [c1 * e + c0 if e is not None else c1 for e in ends]     # at the ends (∞: the slope's sign)
        if ends[0] == 0 and c0 == 0:
            near[0] = c1        # d → 0 as μ → 0: its sign there is the slope's
        signs = {1 if v > 0 else -1 if v < 0 else 0 for v in near}
        return signs.pop() if len(signs) == 1 and 0 not in signs else None
    return None


def truth_at(sp, xs, cond, points):
    """cond at the points (one sequence of values per variable in xs), as booleans: in floats,
    thresholds included, so a probe placed at a threshold's float is exactly on it (SymPy
    would compare float(e^0.4) with e^0.4 itself, and evaluating each point costs ~1 ms)."""
    import numpy as np
    # every threshold as the float a probe at it was placed on, so that a tie is a tie (numpy's
    # e^0.4 − 1 may round to another double than SymPy's); relations are x ⋚ number here
    cond = cond.xreplace({rel: rel.func(rel.lhs, sp.Float(float(rel.rhs)), evaluate=False)
                          for rel in relations(sp, cond)})
    try:
        out = numpy_fn(list(xs), cond)(*[np.asarray(p, dtype=float) for p in points])
    except NotImplementedError:      # a function numpy_fn lacks: SymPy, point by point
        out = [bool(cond.xreplace({x: sp.Float(v) for x, v in zip(xs, pt)})) for pt in zip(*points)]
    return np.broadcast_to(np.asarray(out, dtype=bool), (len(points[0]),))


def relations(sp, cond) -> list:
    """The relations inside a condition in SymPy's canonical order: a set's order follows the
    symbols' string hashes, which differ from process to process (PYTHONHASHSEED)."""
    return sorted(cond.atoms(sp.core.relational.Relational), key=sp.default_sort_key)
