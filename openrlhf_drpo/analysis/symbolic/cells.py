"""Settling a condition whose thresholds move with μ and |A| and change order as they move:
clip(r, 1 − 0.2·μ, 1 + 0.2·(1 − μ)) (whose upper threshold meets r = 1 at μ = 1), BandPO's
max(0, 1 − δ/μ) and min(1/μ, 1 + δ/μ, 10) (which trade places at μ = δ, 1/180, 0.1, 0.95).
The domain of the outer variables (0 < μ ≤ 1, a = |A| > 0) is cut where two thresholds, or a
threshold and an end of t's range, meet (in closed form, exactly); between the cuts their order is
fixed, so each cell is settled along t as analysis.symbolic.intervals settles fixed thresholds, with the
thresholds written back. A cell then takes, of the formulas found, one that gives the condition's
own truth on every probe of that cell (every pattern of relations the cell holds), so a cut that
changes nothing (a threshold leaving t's range) leaves no trace: the result has as few pieces
as the cells allow. Every step is exact: cuts are roots in closed form, and orders are decided
at those cuts (ties known from the roots themselves) or between them."""
from __future__ import annotations

import functools
import itertools
import math

from openrlhf_drpo.analysis.symbolic.intervals import intervals, probe_points, relations
from openrlhf_drpo.analysis.numeric.sampling import numpy_fn

BUDGET_CELLS = 400      # cells of the outer variables times t's probes; past it, kept as built
ROOT_DEGREE = 4         # polynomial degree whose roots are taken in closed form


@functools.lru_cache(maxsize=1024)
def settle_moving(dom, cond):
    """cond, whose relations are t ⋚ c(μ, a), μ ⋚ m or a ⋚ b (numbers m, b), as the shortest
    union of (outer cell, condition in t) pieces; None where a cut is not found in closed
    form or two thresholds' order is not decided exactly (kept as built). (Cached: the two
    signs of A meet the same conditions in one direction; half of BandPO's calls repeat.)"""
    sp, t = dom.sp, dom.t
    inner, outer = [], []
    for rel in relations(sp, cond):
        if rel.lhs == t and rel.rhs.free_symbols <= {dom.mu, dom.a}:
            inner.append(rel)
        elif rel.lhs in (dom.mu, dom.a) and rel.rhs.is_number:
            outer.append(rel)
        else:
            return None
    cs = sorted({rel.rhs for rel in inner}, key=sp.default_sort_key)
    xs = [x for x in (dom.mu, dom.a) if any(x in c.free_symbols for c in cs) or any(r.lhs == x for r in outer)]
    if not xs or not cs:
        return None
    cuts = {x: {} for x in xs}
    for rel in outer:
        _add_cut(cuts[rel.lhs], rel.rhs, None)
    ends = (sp.Integer(0),) + ((dom.tmax,) if dom.tmax is not None else ())
    for c, d in [(c, d) for i, c in enumerate(cs) for d in cs[i + 1:]] + [(c, e) for c in cs for e in ends]:
        found = _meeting(dom, c, d)
        if found is None:
            return None
        for x, root in found:
            _add_cut(cuts[x], root, (c, d if d in cs else float(d)))
    axes = []
    for x in xs:
        floats, probes = probe_points(dom, x, set(cuts[x]))
        axes.append((x, floats, {f: v for f, (v, _) in cuts[x].items()}, probes,
                     {f: ties for f, (_, ties) in cuts[x].items()}))
    if math.prod(len(a[3]) for a in axes) * (2 * len(cs) + 1) > BUDGET_CELLS:
        return None
    cells = _cells(dom, cs, axes)
    if cells is None:
        return None
    names = [sp.Dummy(f"c{i}") for i in range(len(cs))]
    swap = {rel: rel.func(t, names[cs.index(rel.rhs)], evaluate=False) for rel in inner}
    truth = _truth(dom, cond.xreplace(swap), names, xs, cells)
    for cell, held in zip(cells, truth):
        cell["truth"] = held
    return _rebuild(dom, cs, names, xs, axes, cells)


def _add_cut(found, value, tie):
    """A cut at value (one cut for values within a double's rounding), with the pair of
    thresholds (or a threshold and an end of t's range) that tie there."""
    f = float(value)
    key = next((k for k in found if abs(k - f) <= 1e-12 * max(1.0, abs(f))), f)
    _, ties = found.setdefault(key, (value, []))
    if tie is not None:
        ties.append(tie)


@functools.lru_cache(maxsize=4096)
def _meeting(dom, c, d):
    """[(variable, value)] where thresholds c and d (or an end of t's range) meet inside the
    domain: none where their order is fixed, the roots where their difference reads one
    variable; None where neither is decided exactly. (Cached: each pair recurs in every
    condition of a case.)"""
    sp = dom.sp
    diff = sp.cancel(c - d)
    free = diff.free_symbols
    if not free:
        return None if diff == 0 else []
    if len(free) > 1:
        # against an end of t's range, touching it is enough: t never lies beyond it
        return None if _fixed_sign(dom, diff, weak=d in (0, dom.tmax)) is None else []
    (x,) = free
    roots = crossings(sp, diff, x, 1 if x == dom.mu else None)
    return None if roots is None else [(x, root) for root in roots]


def crossings(sp, d, x, hi):
    """The x in (0, hi] (hi None: (0, ∞)) where d(x) may change sign, exactly: its zeros and
    poles, the roots of its numerator's and denominator's polynomial factors (of degree up to
    ROOT_DEGREE). Square roots are eliminated first (p + q·√s = 0 only where p² = q²·s) and
    each root so found is kept only where the numerator or denominator itself is 0 (to 30
    digits). None where that fails."""
    out = []
    for part in sp.fraction(sp.together(d)):
        part = sp.expand(part)
        poly, radical = part, False
        for _ in range(ROOT_DEGREE):
            bases = sorted({p.base for p in poly.atoms(sp.Pow) if p.exp.is_Rational and p.exp.q == 2
                            and x in p.free_symbols}, key=sp.default_sort_key)
            if not bases:
                break
            b, radical, y = bases[0], True, sp.Dummy("y")
            # b^(k/2) as y^k, then y² = b: the even powers of y are p, the odd ones q·y
            split = poly.replace(lambda e: e.is_Pow and e.base == b and e.exp.is_Rational and e.exp.q == 2,
                                 lambda e: y ** int(2 * e.exp))
            try:
                terms = sp.Poly(split, y).terms()
            except sp.PolynomialError:
                return None
            p = sum((c * b ** (k[0] // 2) for k, c in terms if k[0] % 2 == 0), sp.Integer(0))
            q = sum((c * b ** (k[0] // 2) for k, c in terms if k[0] % 2 == 1), sp.Integer(0))
            poly = sp.expand(sp.fraction(sp.together(p ** 2 - q ** 2 * b))[0])
        if x not in poly.free_symbols:
            continue
        try:
            factors = sp.factor_list(sp.Poly(poly, x))[1]
        except sp.PolynomialError:      # a function of x that is not a polynomial after all (e^x, x^(1/3))
            return None
        for factor, _ in factors:
            if factor.degree() > ROOT_DEGREE:
                return None
            found = sp.roots(factor)
            if sum(found.values()) != factor.degree():
                return None
            for root in found:
                value = complex(root.evalf(30))
                if abs(value.imag) > 1e-12 * max(1.0, abs(value.real)) or value.real <= 0 or \
                        (hi is not None and value.real > hi * (1 + 1e-15)):
                    continue
                if radical:
                    terms = sp.Add.make_args(part.subs(x, root))
                    scale = sum(abs(complex(term.evalf(30))) for term in terms)
                    if abs(complex(sp.Add(*terms).evalf(30))) > 1e-20 * max(scale, 1e-300):
                        continue        # a root of p² = q²·s where p = +q·√s, not −q·√s
                if root not in out:
                    out.append(root)
    return sorted(out, key=lambda v: float(v))


def in_outer(dom, rel):
    """A relation h(μ, a) ⋚ 0 (no t) that in_mu leaves as built: true or false where h keeps
    one sign (decided), else in one variable intervals between its roots (in_one); else None.
    (Cached: a case's two directions and the two signs of A meet the same relations.)"""
    return _in_outer(dom, rel.func, rel.lhs - rel.rhs)


@functools.lru_cache(maxsize=1024)
def _in_outer(dom, func, h):
    rel = func(h, 0, evaluate=False)
    solved = in_one(dom, rel) if len(h.free_symbols) == 1 else None
    return decided(dom, rel) if solved is None else solved


def decided(dom, rel):
    """A relation h(μ, a) ⋚ 0 (no t) whose h keeps one sign over the domain: true or false
    (7·|A|·(1 − μ)/25 + μ/5 ≤ 0 is false); else None."""
    sp = dom.sp
    h = rel.lhs - rel.rhs
    if not h.free_symbols or not h.free_symbols <= {dom.mu, dom.a}:
        return None
    sign = _fixed_sign(dom, h)
    if sign is None:
        return None
    return sp.true if bool(rel.func(sp.Integer(sign), 0)) else sp.false


def in_one(dom, rel):
    """A relation h(x) ⋚ 0 in one outer variable (μ or a = |A|) that is not linear: constant
    between h's zeros and poles, found in closed form, so rebuilt as intervals of x
    (√(δ(1 − μ)/μ) ≥ 9 reads μ ≤ 1/1621); None where they are not found or h is undefined."""
    import numpy as np
    sp = dom.sp
    h = rel.lhs - rel.rhs
    if len(h.free_symbols) != 1 or not h.free_symbols <= {dom.mu, dom.a}:
        return None
    (x,) = h.free_symbols
    roots = crossings(sp, h, x, 1 if x == dom.mu else None)
    den = sp.fraction(sp.together(h))[1]
    if roots is None or any(abs(complex(den.subs(x, v).evalf(30))) < 1e-20 for v in roots):
        return None         # a pole: h is undefined there, and so is the objective
    exact = {float(v): v for v in roots}
    cuts, probes = probe_points(dom, x, set(exact))
    with np.errstate(all="ignore"):
        values = np.broadcast_to(np.asarray(numpy_fn([x], h)(np.array(probes)), dtype=float), (len(probes),)).copy()
    values[1::2] = 0.0      # at a root, h is 0 exactly (a double may miss it by rounding)
    if not np.isfinite(values).all():
        return None
    compare = {sp.Lt: np.less, sp.Le: np.less_equal, sp.Gt: np.greater, sp.Ge: np.greater_equal,
               sp.Eq: np.equal, sp.Ne: np.not_equal}.get(rel.func)
    if compare is None:
        return None
    return intervals(sp, x, cuts, exact, [bool(v) for v in compare(values, 0.0)])


def _fixed_sign(dom, d, weak=False):
    """+1 or −1 where d(μ, a) keeps that sign for 0 < μ ≤ 1 and a > 0 (or, weak, is 0 at
    most where it does not), shown from its expanded numerator and denominator with
    μ = 1/(1 + v), v ≥ 0; else None."""
    sp = dom.sp
    v = sp.Dummy("v", nonnegative=True)
    num, den = (sp.expand(e) for e in sp.fraction(sp.together(d.xreplace({dom.mu: 1 / (1 + v)}))))
    signs = [1 if e.is_positive or (weak and e.is_nonnegative) else -1 if e.is_negative or (weak and e.is_nonpositive)
             else None for e in (num, den)]
    return None if None in signs else signs[0] * signs[1]


def _cells(dom, cs, axes):
    """Every cell (a probe of each outer variable): its thresholds' values as doubles (ties at
    a cut made exact, so that t's probes at one threshold are at the other too) and t's probes."""
    import numpy as np
    sp = dom.sp
    grid = list(itertools.product(*(range(len(a[3])) for a in axes)))
    at = [np.array([a[3][index[k]] for index in grid]) for k, a in enumerate(axes)]
    xs = [a[0] for a in axes]
    columns = []
    for c in cs:
        with np.errstate(all="ignore"):
            v = np.broadcast_to(np.asarray(numpy_fn(xs, c)(*at), dtype=float), (len(grid),))
        if not np.isfinite(v).all():
            return None
        columns.append(v)
    hi = float(dom.tmax) if dom.tmax is not None else math.inf
    cells = []
    for n, index in enumerate(grid):
        values = {c: float(col[n]) for c, col in zip(cs, columns)}
        ties = [tie for a, k in zip(axes, index) if k % 2 for tie in a[4][a[1][k // 2]]]
        for c, d in sorted(ties, key=lambda p: sp.default_sort_key(p[0])):
            if isinstance(d, float):
                values[c] = d
            else:
                values[d] = values[c]
        exact = {}
        for c in cs:
            exact.setdefault(values[c], c)
        cuts, probes = probe_points(dom, dom.t, {v for v in values.values() if 0 < v < hi})
        cells.append({"at": {x: a[3][k] for x, a, k in zip(xs, axes, index)}, "values": values,
                      "cuts": cuts, "exact": {v: exact[v] for v in cuts}, "probes": probes})
    return cells


def _truth(dom, cond, names, xs, cells):
    """cond (its thresholds named) on every cell's probes along t, in one evaluation."""
    import numpy as np
    sizes = [len(c["probes"]) for c in cells]
    cols = [np.concatenate([c["probes"] for c in cells])]
    cols += [np.repeat([c["values"][k] for c in cells], sizes) for k in cells[0]["values"]]
    cols += [np.repeat([c["at"][x] for c in cells], sizes) for x in xs]
    # numbers as doubles, as the probes were placed (a probe at a cut μ = m is float(m) itself)
    held = np.broadcast_to(np.asarray(numpy_fn([dom.t, *names, *xs], cond)(*cols), dtype=bool), cols[0].shape)
    return [list(part) for part in np.split(held, np.cumsum(sizes)[:-1])]


def _rebuild(dom, cs, names, xs, axes, cells):
    """The fewest formulas that give every cell its truth (greedily, the one that holds on
    most cells first), each with the region of the cells it covers."""
    sp, t = dom.sp, dom.t
    built = {}      # cells alike (one pattern on the same thresholds) build their formula once
    for c in cells:
        key = (tuple(c["cuts"]), tuple(c["exact"][v] for v in c["cuts"]), tuple(c["truth"]))
        if key not in built:
            built[key] = intervals(sp, t, c["cuts"], c["exact"], c["truth"])
    formulas = list(dict.fromkeys(built.values()))
    holds = {}
    for f in formulas:
        if f in (sp.true, sp.false):
            holds[f] = [all(v == (f == sp.true) for v in c["truth"]) for c in cells]
            continue
        swap = {rel: rel.func(t, names[cs.index(rel.rhs)], evaluate=False) for rel in relations(sp, f)}
        holds[f] = [got == c["truth"] for got, c in zip(_truth(dom, f.xreplace(swap), names, xs, cells), cells)]
    chosen, left = [], set(range(len(cells)))
    while left:
        best = max(formulas, key=lambda f: (sum(holds[f][i] for i in left), -formulas.index(f)))
        chosen.append(best)
        left -= {i for i in left if holds[best][i]}
    if len(chosen) == 1:
        return chosen[0]
    # a cell two formulas hold on (a cut, where they meet) goes with the cell below it in μ
    # (or |A|), so that each formula's region is as few intervals as possible
    shape = [len(a[3]) for a in axes]
    owner = []
    for i in range(len(cells)):
        fits = [f for f in chosen if holds[f][i]]
        below = i - math.prod(shape[1:]) if i >= math.prod(shape[1:]) else None
        owner.append(owner[below] if below is not None and owner[below] in fits else fits[0])
    out = []
    for f in chosen:
        if f == sp.false:
            continue
        where = _region(sp, axes, [o == f for o in owner], shape)
        out.append(where if f == sp.true else sp.And(where, f))
    return sp.Or(*out)


def _region(sp, axes, marked, shape):
    """The union of the outer cells marked (flattened over axes' probes), as intervals of
    one variable, or of the outer one with the inner one's intervals."""
    import numpy as np
    marked = np.array(marked, dtype=bool).reshape(shape)
    matters = [k for k in range(len(axes)) if (marked != marked.take([0], axis=k)).any()]
    if not matters:
        return sp.true if marked.all() else sp.false

    def along(k, truth):
        x, floats, exact, _, _ = axes[k]
        return intervals(sp, x, floats, exact, list(truth))
    if len(matters) == 1:
        k = matters[0]
        return along(k, marked.take(0, axis=1 - k) if len(axes) > 1 else marked)
    out, seen = [], []
    for row in marked.T:        # one pattern in μ per cell of a, as analysis.symbolic.intervals.settle_cells
        if any((row == s).all() for s in seen):
            continue
        seen.append(row)
        where = [bool((other == row).all()) for other in marked.T]
        out.append(sp.And(along(1, where), along(0, row)))
    return sp.Or(*out)
