"""The symbolic derivation of an objective's weight, case by case.

With μ fixed, ∇r = r∇log π, so a per-token objective ℓ(r, μ, A) has gradient
(∂ℓ/∂r)·r·∇log π and induced weight w = (∂ℓ/∂r)/A relative to the surrogate r·A.
∂ℓ/∂r comes from the IR's own derivative rules (dsl.walks.derivative), the same ones the
torch compiler uses. Each case (sign of A × direction of the update) substitutes signed
positive symbols, A = ±a and r = 1 ± t, so SymPy can settle Piecewise conditions cheaply
instead of running its general inequality solvers, which can take seconds or recurse.
What this module derives are claims: dsl.confirm checks each against the numeric arbiter.
"""
from __future__ import annotations

import math

from .operations import OPS
from .walks import to_sympy
from .sampling import numpy_fn

SIGNS = (("positive", 1), ("negative", -1))
DIRECTIONS = ("diverging", "converging")
BUDGET_CELLS = 400     # cells a condition is tabulated on (settle_cells); past it, kept as built


# ------------------------------------------------------------------ the weight
def degree(sp, e) -> int:
    """An upper bound on e's degree as a polynomial in its symbols, from its tree alone
    (cancel and factor_terms cost grows with it: degree 9 takes SymPy seconds)."""
    if e.is_Symbol:
        return 1
    if e.is_Pow and e.exp.is_Integer:
        return abs(int(e.exp)) * degree(sp, e.base)
    if e.is_Mul:
        return sum(degree(sp, a) for a in e.args)
    return max((degree(sp, a) for a in e.args), default=0)


def tidy(sp, e):
    """Cheap canonical form: 1 - 2·μ·(r - 1)/25 rather than an expanded sum."""
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*[(tidy(sp, x), c) for x, c in e.args])
    if any(p.exp.is_Integer and abs(p.exp) > 8 for p in e.atoms(sp.Pow)):
        return e        # expanding (1 - t)^127 gives huge alternating terms that cancel badly in floats
    e = sp.cancel(e) if e.is_rational_function() else e
    # exp(A·(r − 1)) stays whole: exp(−A)·exp(A·r) is 0·inf in floats for |A| = 1000
    const, rest = sp.expand(e, power_exp=False, power_base=False, log=False).as_coeff_Add()
    return const + sp.factor_terms(rest)


def full_weight(ctx, cases):
    """w over r, mu, A and the parameter names. Smooth objectives keep their parameters
    symbolic; a piecewise one is assembled from its four case weights (at parameter values),
    since folding nested Piecewise symbolically can take SymPy seconds."""
    sp = ctx.sp
    if not any(n.op in OPS and OPS[n.op].piecewise for n in ctx.dl.walk()):
        dl = to_sympy(ctx.dl, sp, ctx.env(True))
        w = dl.subs(sp.Abs(ctx.A), ctx.A * sp.sign(ctx.A)) / ctx.A
        return ctx.tidy(w)
    by = {(c["advantage"], c["direction"]): c["weight"] for c in cases}
    A, r = ctx.A, ctx.r
    # equal neighbours merged here: SymPy would write (A > 0) and ((A > 0) or (r > 1))
    pos = [(by["positive", "diverging"], (A > 0) & (r > 1)), (by["positive", "converging"], A > 0)]
    neg = [(by["negative", "diverging"], r < 1), (by["negative", "converging"], True)]
    pos, neg = ([side[1]] if side[0][0] == side[1][0] else side for side in (pos, neg))
    if len(pos) == len(neg) == 1 and pos[0][0] == neg[0][0]:
        return pos[0][0]
    return sp.Piecewise(*pos, *neg)


# ------------------------------------------------------------------ the derivation
def derive(ctx):
    """The four cases' weights, and per sign of A the candidate boundaries: zeros of a
    piece, edges where a piece ends (w may jump there), and r = 1 where the cases meet."""
    sp = ctx.sp
    cases, candidates = [], {}
    entangled = False
    for adv, sign in SIGNS:
        found = [_candidate(ctx, sp.Integer(1), probe=False)]
        for direction in DIRECTIONS:
            s, tmax, pieces = _case_weight(ctx, sign, direction)
            entangled |= any(ctx.a in (e.free_symbols | c.free_symbols) for e, c in pieces)
            back = {ctx.t: s * (ctx.r - 1), ctx.a: sign * ctx.A}
            shown = _as_piecewise(sp, [(ctx.tidy(e.subs(back)), _in_r(ctx, c, s).subs(back)) for e, c in pieces])
            cases.append({"advantage": adv, "direction": direction, "weight": shown,
                          "_pieces": pieces, "_s": s, "_tmax": tmax})
            a_back = {ctx.a: sign * ctx.A}
            for zero in _zeros(ctx, pieces, tmax):
                if zero[0] == "implicit":
                    # unevaluated: SymPy's Eq would ask its assumptions whether h is 0 (seconds at degree 9)
                    found.append(_candidate(ctx, sp.Eq(zero[1].subs(ctx.t, s * (ctx.r - 1)).subs(a_back), 0,
                                                       evaluate=False)))
                elif isinstance(zero[0], sp.Expr) and zero[0].is_real is not False and zero[0] != 0:
                    # (a Symbol is a Boolean to SymPy too; r = 1 itself is the seam's candidate)
                    found.append(_candidate(ctx, ctx.tidy(1 + s * zero[0]).subs(a_back)))
            found += [_candidate(ctx, (1 + s * e).subs(a_back), probe=False) for e in _edges(ctx, pieces)]
        candidates[adv] = [c for c in found if c is not None]
    return cases, candidates, entangled


def _candidate(ctx, r_star, probe=True):
    """A place the symbolic path says w may change sign, as (r*, π*(), g, explicit): g(r, μ, A)
    is 0 there, and explicit(μ, A) gives r* for a closed-form zero of w, which the arbiter
    also probes outside the domain (an edge or r = 1 is only a place w might jump)."""
    sp = ctx.sp
    if isinstance(r_star, sp.logic.boolalg.BooleanAtom):    # an implicit edge that is constant: no place
        return None
    if isinstance(r_star, sp.Eq):
        h = r_star.lhs - r_star.rhs
        try:
            g = numpy_fn([ctx.r, ctx.mu, ctx.A], h)
        except Exception:       # noqa: BLE001 - an implicit edge numpy cannot build: left to the arbiter
            return None
        return r_star, (lambda: sp.Eq(h.subs(ctx.r, ctx.pi / ctx.mu), 0)), g, None
    explicit = numpy_fn([ctx.mu, ctx.A], r_star)
    # π* is built only for a candidate the arbiter keeps: tidying each one costs SymPy time
    return r_star, (lambda: ctx.tidy(ctx.mu * r_star)), (lambda r, mu, A: r - explicit(mu, A)), \
        explicit if probe else None


# ------------------------------------------------------------------ cases
def _case_subs(ctx, sign, direction):
    """A = sign·a, r = 1 + s·t with s = +sign when diverging (A·(r-1) > 0), else -sign."""
    s = sign if direction == "diverging" else -sign
    return s, {"r": 1 + s * ctx.t, "pi": ctx.mu * (1 + s * ctx.t), "A": sign * ctx.a}


class _Settle:
    """The lowering hook for one case: every condition is rewritten, as soon as it is built,
    to relations t ⋚ c and settled against the case's domain 0 < t < tmax, so Piecewise
    never nests conditions SymPy would have to untangle later."""

    def __init__(self, ctx, tmax):
        self.ctx, self.tmax = ctx, tmax
        self.steps = 0      # conditions and relations settled: the work counted against BUDGET["settle"]
        self.memo: dict = {}

    def _count(self):
        from .analysis import check_budget
        self.steps += 1
        check_budget("settle", self.steps)

    def _memo(self, fn, x):
        """fn(x) once per case: folding rebuilds the same conditions many times over. A repeat
        counts the steps its first settling took, so the budget, and with it the report, is
        exactly what settling it again would give (steps go up by one: the first past the
        budget is budget + 1)."""
        from .analysis import BUDGET, check_budget
        key = (fn, x)
        if key in self.memo:
            out, steps = self.memo[key]
            self.steps = min(self.steps + steps, BUDGET["settle"] + 1)
            check_budget("settle", self.steps)
            return out
        before = self.steps
        out = fn(x)
        self.memo[key] = out, self.steps - before
        return out

    def __call__(self, e):
        sp = self.ctx.sp
        if isinstance(e, (sp.Min, sp.Max)):   # first argument attaining the extreme, as in the IR rule
            le, lt = (sp.Le, sp.Lt) if isinstance(e, sp.Min) else (sp.Ge, sp.Gt)
            args = [self(x) if isinstance(x, (sp.Min, sp.Max)) else x for x in e.args]
            e = sp.Piecewise(*[(x, self.cond(sp.And(*[(lt if j < i else le)(x, y, evaluate=False)
                                                      for j, y in enumerate(args) if j != i])))
                               for i, x in enumerate(args)][:-1], (args[-1], True))
        if isinstance(e, sp.Piecewise):
            pieces = []
            for x, c in e.args:
                c = self.cond(c)
                if c == sp.false:
                    continue
                pieces.append((x, c))
                if c == sp.true:
                    break
            if not pieces:
                return sp.nan
            if pieces[0][1] == sp.true:
                return pieces[0][0]
            return sp.Piecewise(*pieces[:-1], (pieces[-1][0], True))
        if isinstance(e, sp.logic.boolalg.Boolean) and not isinstance(e, sp.Symbol):
            return self.cond(e)
        return e

    def cond(self, c):
        return self._memo(self._cond, c)

    def _cond(self, c):
        sp = self.ctx.sp
        self._count()
        if c in (True, False, sp.true, sp.false):
            return sp.true if c in (True, sp.true) else sp.false
        if isinstance(c, sp.ITE):   # SymPy writes a Piecewise inside a condition as ITE
            i, x, y = c.args
            return self.cond(sp.Or(sp.And(i, x), sp.And(sp.Not(i), y)))
        if isinstance(c, (sp.And, sp.Or, sp.Not)):
            out = c.func(*[self.cond(x) for x in c.args])
        elif isinstance(c, sp.core.relational.Relational):
            out = self.relation(c)
        else:
            return c
        if out in (sp.true, sp.false):
            return out
        if self.ctx.a in out.free_symbols or len(out.free_symbols & {self.ctx.t, self.ctx.mu}) > 1:
            settled = self.settle_cells(out)
            if settled is not None:
                return settled
        if out.free_symbols == {self.ctx.mu}:
            return self.settle(out, self.ctx.mu)
        if self.ctx.t not in out.free_symbols:
            return out
        if out.free_symbols == {self.ctx.t}:
            return self.settle(out)
        settled = self.settle_mu(out)
        return self.settle_one(out) if settled is None else settled

    def settle_one(self, cond):
        """A condition whose relations all compare t with one expression c(μ): its truth
        depends only on t < c, t = c or t > c, so it is one of t ≤ c, t < c, t ≥ c, t > c,
        t = c, t ≠ c, true or false (μ-dependent clips print as a person would write them)."""
        sp, t = self.ctx.sp, self.ctx.t
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

    def settle(self, cond, x=None, exact=None):
        """A condition in one variable x (t, |A| = a or μ) is constant between its thresholds:
        evaluate it at each threshold and between them, then rebuild the shortest equivalent,
        a union of intervals (t ≤ c, c < t ≤ d, ...). exact maps a threshold's float to the
        expression printed for it. (SymPy's as_set does the same job about a hundred times slower.)"""
        sp = self.ctx.sp
        x = self.ctx.t if x is None else x
        rels = _relations(sp, cond)
        if any(rel.lhs != x or not rel.rhs.is_number for rel in rels):
            return cond
        exact = {**{float(rel.rhs): rel.rhs for rel in rels}, **(exact or {})}
        cuts, probes = self._probes(x, {float(rel.rhs) for rel in rels})
        return self._intervals(x, cuts, exact, list(_truth(sp, [x], cond, [probes])))

    def _probes(self, x, cuts):
        """The thresholds inside x's range, ascending, and the points that tell every cell
        apart: even index inside an interval, odd index a threshold itself. t ranges over
        (0, tmax), a over (0, ∞), μ over (0, 1] (μ = 1 is in the domain; t = tmax, π = 0, is not)."""
        closed = x == self.ctx.mu
        hi = 1.0 if closed else float(self.tmax) if x == self.ctx.t and self.tmax is not None else math.inf
        cuts = sorted(c for c in cuts if 0 < c < hi or (closed and c == hi))
        edges = [0.0] + cuts + ([] if closed and cuts and cuts[-1] == hi else [hi])
        probes = []
        for i in range(len(edges) - 1):
            a, b = edges[i], edges[i + 1]
            probes.append((a + b) / 2 if math.isfinite(b) else a + 1.0)
            if i < len(cuts):
                probes.append(cuts[i])
        return cuts, probes

    def _intervals(self, x, cuts, exact, truth):
        """The union of intervals of x where truth (over _probes' points) holds."""
        sp = self.ctx.sp
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

    def settle_cells(self, cond):
        """A condition whose relations each compare one of t, |A| = a or μ with a number is
        constant on the cells between those numbers, so it is tabulated there and rebuilt:
        an empty region becomes false; in two variables it reads as intervals of the outer
        one (|A| or μ), each with its condition in r: (2 ≤ |A| ≤ 20 and r ≤ 1.2) or |A| > 20
        or |A| < 2. Else None (kept as built)."""
        import itertools
        import numpy as np
        sp, ctx = self.ctx.sp, self.ctx
        swap, exact = {}, {}
        for rel in _relations(sp, cond):
            h = sp.expand(rel.lhs - rel.rhs)
            if len(h.free_symbols) != 1 or not h.free_symbols <= {ctx.t, ctx.a, ctx.mu}:
                return None
            (x,) = h.free_symbols
            if (line := _linear(h, x)) is None:
                return None
            c1, c0 = line
            swap[rel] = (rel.func if c1 > 0 else _flipped(sp, rel.func))(x, -c0 / c1)
            exact.setdefault(x, {})[float(-c0 / c1)] = -c0 / c1
        cond = cond.xreplace(swap)
        xs = sorted(exact, key=lambda x: x != ctx.t)      # t first: the inner variable
        axes = [self._probes(x, set(exact[x])) for x in xs]
        if math.prod(len(p) for _, p in axes) > BUDGET_CELLS:
            return None
        points = list(zip(*itertools.product(*(p for _, p in axes))))
        truth = _truth(sp, xs, cond, points).reshape([len(p) for _, p in axes])
        matters = [k for k in range(len(xs)) if (truth != truth.take([0], axis=k)).any()]
        if len(matters) > 2:
            return None
        # the variables that matter first (inner, then outer), the others at any value
        table = truth.transpose(matters + [k for k in range(len(xs)) if k not in matters])
        table = table.reshape([truth.shape[k] for k in matters] + [-1])[..., 0]
        if len(matters) < 2:
            return sp.false if not truth.any() else sp.true if truth.all() else \
                self._intervals(xs[matters[0]], axes[matters[0]][0], exact[xs[matters[0]]], list(table))
        inner, outer = matters
        out, seen = [], []
        for row in table.T:        # one pattern in the inner variable per cell of the outer one
            if any((row == s).all() for s in seen):
                continue
            seen.append(row)
            where = [bool((other == row).all()) for other in table.T]
            out.append(sp.And(self._intervals(xs[outer], axes[outer][0], exact[xs[outer]], where),
                              self._intervals(xs[inner], axes[inner][0], exact[xs[inner]], list(row))))
        return sp.Or(*out)

    def settle_mu(self, cond):
        """A condition whose relations compare t with thresholds c(μ) that keep one order
        over 0 < μ ≤ 1 (and against t's own range): its truth pattern along t is the same at
        every μ, so it is settled at μ = 1/2 and the thresholds written back. Empty regions
        (t ≥ 2 and t ≤ μ) become false. The order is decided exactly (see _fixed_sign)."""
        sp, t, mu = self.ctx.sp, self.ctx.t, self.ctx.mu
        rels = _relations(sp, cond)
        if any(rel.lhs != t or not rel.rhs.free_symbols <= {mu} for rel in rels):
            return None
        cs = sorted({rel.rhs for rel in rels}, key=sp.default_sort_key)
        ends = [sp.Integer(0)] + ([self.tmax] if self.tmax is not None else [])
        for i, c in enumerate(cs):
            for d in cs[i + 1:] + [e for e in ends if c.free_symbols]:
                if _fixed_sign(sp, mu, c - d) is None:
                    return None
        half = sp.Rational(1, 2)
        at = {float(c.xreplace({mu: half})): c for c in cs}
        if len(at) != len(cs):
            return None
        return self.settle(cond.xreplace({mu: half}), exact=at) if at else None

    def fold(self, e, cond=None):
        """[(expr, condition)] without Piecewise, conditions settled and mutually exclusive.
        SymPy's piecewise_fold does this too, but calls simplify_logic, which is slow."""
        sp = self.ctx.sp
        cond = sp.true if cond is None else cond
        found = e.atoms(sp.Piecewise)
        if not found:
            return [(e, cond)]
        P = min(found, key=sp.default_sort_key)     # a set: pick the same one in every process
        out, before = [], []
        for x, c in P.args:   # first match wins: branch i also excludes branches 1..i-1
            cc = self.cond(sp.And(cond, *before, c))
            before.append(sp.Not(c))
            if cc != sp.false:
                out += self.fold(e.xreplace({P: x}), cc)
        return out

    def relation(self, e):
        if not isinstance(e, self.ctx.sp.core.relational.Relational):
            return e
        return self._memo(self._relation, e)

    def _relation(self, e):
        sp, t = self.ctx.sp, self.ctx.t
        self._count()
        h = e.lhs - e.rhs
        if h.has(sp.Piecewise):   # distribute: h_i ⋚ 0 where piece i holds
            return self.cond(sp.Or(*[sp.And(c, self.relation(e.func(x, 0))) for x, c in self.fold(h)]))
        h = sp.expand(h)
        if t not in h.free_symbols:
            return self.in_mu(e.func, h)
        # log(x) ⋚ c ⟺ x ⋚ e^c: log is increasing, and where x ≤ 0 the objective is undefined
        # anyway (GMPO's clip in log space, OPSM's mean log-ratio)
        logs = [a for a in sp.Add.make_args(h) if isinstance(a, sp.log) and t in a.free_symbols]
        if len(logs) == 1 and t not in (h - logs[0]).free_symbols:
            return self.relation(e.func(logs[0].args[0] - sp.exp(-(h - logs[0])), 0, evaluate=False))
        poly = h.as_poly(t)
        if poly is None or poly.degree() != 1:
            return e.func(h, 0)
        c1, c0 = poly.all_coeffs()
        func = e.func if c1.is_positive else _flipped(sp, e.func) if c1.is_negative else None
        if func is None:
            return e.func(h, 0)
        c = sp.cancel(-c0 / c1)
        return func(t, sp.expand(c) if c.has(sp.exp) else c)      # (e^0.4 − 1)·e^-0.4 is 1 − e^-0.4


    def in_mu(self, func, h):
        """h ⋚ 0 without t, as μ ⋚ m where it is linear in μ or 1/μ (a = |A| > 0 and μ > 0
        divided out): 1/μ ≥ 10 reads μ ≤ 0.1, a·μ − 2a ≥ 0 reads μ ≥ 2 (false in the domain)."""
        sp, mu, a = self.ctx.sp, self.ctx.mu, self.ctx.a
        if a in h.free_symbols:
            q = sp.cancel(h / a)
            h = q if a not in q.free_symbols else h
        if h.free_symbols == {mu}:
            for g in (h, sp.expand(h * mu)):
                if (line := _linear(g, mu)) is not None:
                    c1, c0 = line
                    return (func if c1.is_positive else _flipped(sp, func))(mu, -c0 / c1)
        return func(h, 0)


def _flipped(sp, func):
    """The relation that holds once both sides are multiplied by a negative number."""
    return {sp.Lt: sp.Gt, sp.Le: sp.Ge, sp.Gt: sp.Lt, sp.Ge: sp.Le}.get(func, func)


def _linear(g, x):
    """(c1, c0) where g = c1·x + c0 with numbers c1 ≠ 0 and c0, else None."""
    poly = g.as_poly(x)
    if poly is None or poly.degree() != 1 or not all(c.is_number for c in poly.all_coeffs()):
        return None
    return tuple(poly.all_coeffs())


def _fixed_sign(sp, mu, d):
    """+1 or −1 when d(μ) keeps that sign over 0 < μ ≤ 1, decided exactly for d linear in μ
    or in 1/μ (monotone, so its two ends decide), else None."""
    d = sp.expand(d)
    if d.is_number:
        return None if d == 0 else (1 if d > 0 else -1)
    nu = sp.Dummy("nu", positive=True)
    for g, var, ends in ((d, mu, (0, 1)), (sp.expand(d.xreplace({mu: 1 / nu})), nu, (1, None))):
        if (line := _linear(g, var)) is None:
            continue
        c1, c0 = line
        near = [c1 * e + c0 if e is not None else c1 for e in ends]     # at the ends (∞: the slope's sign)
        if ends[0] == 0 and c0 == 0:
            near[0] = c1        # d → 0 as μ → 0: its sign there is the slope's
        signs = {1 if v > 0 else -1 if v < 0 else 0 for v in near}
        return signs.pop() if len(signs) == 1 and 0 not in signs else None
    return None


def _case_weight(ctx, sign, direction):
    """The weight on one case as [(expr, condition)] over t: conditions are mutually
    exclusive, equal expressions merged, and the last condition stands for 'otherwise'."""
    sp = ctx.sp
    s, subs = _case_subs(ctx, sign, direction)
    tmax = 1 if s < 0 else None
    settle = _Settle(ctx, tmax)
    env = {**ctx.env(False), **subs}
    folded = ctx.limited("settling the case's conditions",
                         lambda: settle.fold(to_sympy(ctx.dl, sp, env, hook=settle) / (sign * ctx.a)))
    if folded is None:   # unsettled, but exact: numerics (range, self-check) still evaluate it
        # SymPy may fail even to build it (a Min over zoo): then no weight is derived, w is
        # reported undefined, and the self-check leaves it unconfirmed
        try:
            w = to_sympy(ctx.dl, sp, env) / (sign * ctx.a)
        except Exception as e:      # SymPy raises many types (TypeError, NotImplementedError, ...)
            ctx.notes.append(f"building the weight: SymPy failed ({type(e).__name__}); w is not derived")
            w = sp.nan
        return s, tmax, [(w, sp.true)]
    merged: dict = {}
    for expr, cond in folded:
        expr = ctx.tidy(expr)
        merged[expr] = settle.cond(sp.Or(merged[expr], cond)) if expr in merged else cond
    pieces = list(merged.items())
    if len(pieces) == 1:
        pieces = [(pieces[0][0], sp.true)]
    return s, tmax, pieces


def _in_r(ctx, cond, s):
    """A settled condition in t as a person writes it, in r: t ≤ c(μ) with r = 1 + s·t reads
    r ≤ 1 + c(μ) (r ≥ 1 − c(μ) when s = −1), never SymPy's μ ≥ 10·r − 10."""
    sp, t = ctx.sp, ctx.t
    swap = {rel: (rel.func if s > 0 else _flipped(sp, rel.func))(ctx.r, ctx.tidy(1 + s * rel.rhs), evaluate=False)
            for rel in _relations(sp, cond) if rel.lhs == t and t not in rel.rhs.free_symbols}
    return cond.xreplace(swap)


def _as_piecewise(sp, pieces):
    if len(pieces) == 1:
        return pieces[0][0]
    return sp.Piecewise(*pieces[:-1], (pieces[-1][0], True))


def _zeros(ctx, pieces, tmax):
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
            out += [(c, sp.true) for c in _thresholds(ctx, eff)]
            out += [("implicit", rel.lhs - rel.rhs, sp.true) for rel in _relations(sp, eff)
                    if t in rel.free_symbols and not _is_threshold(ctx, rel)]
            continue
        if t not in expr.free_symbols:
            continue
        while isinstance(expr, sp.sign) or (expr.is_Mul and any(isinstance(f, sp.sign) for f in expr.args)
                                            and len(expr.args) == 2 and expr.args[0].is_number):
            expr = expr.args[-1] if expr.is_Mul else expr.args[0]      # c·sign(f) = 0 where f = 0
        if not expr.is_rational_function(t):   # transcendental: an implicit boundary, found numerically
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


def _solve_rational(ctx, expr, t):
    """Zeros in t of a rational function: its numerator's factors' roots, in closed form.
    (sp.solve gives the same, but its first call imports the solvers package, ~0.9 s.) Within
    budgets: the expression's size, then each factor's degree ((1 + t)^127 is degree 1)."""
    from .analysis import check_budget, size
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


def _thresholds(ctx, cond) -> list:
    """Every c of a settled relation t ⋚ c inside a condition."""
    return [rel.rhs for rel in _relations(ctx.sp, cond) if _is_threshold(ctx, rel)]


def _truth(sp, xs, cond, points):
    """cond at the points (one sequence of values per variable in xs), as booleans: in floats,
    thresholds included, so a probe placed at a threshold's float is exactly on it (SymPy
    would compare float(e^0.4) with e^0.4 itself, and evaluating each point costs ~1 ms)."""
    import numpy as np
    # every threshold as the float a probe at it was placed on, so that a tie is a tie (numpy's
    # e^0.4 − 1 may round to another double than SymPy's); relations are x ⋚ number here
    cond = cond.xreplace({rel: rel.func(rel.lhs, sp.Float(float(rel.rhs)), evaluate=False)
                          for rel in _relations(sp, cond)})
    try:
        out = numpy_fn(list(xs), cond)(*[np.asarray(p, dtype=float) for p in points])
    except NotImplementedError:      # a function numpy_fn lacks: SymPy, point by point
        out = [bool(cond.xreplace({x: sp.Float(v) for x, v in zip(xs, pt)})) for pt in zip(*points)]
    return np.broadcast_to(np.asarray(out, dtype=bool), (len(points[0]),))


def _relations(sp, cond) -> list:
    """The relations inside a condition in SymPy's canonical order: a set's order follows the
    symbols' string hashes, which differ from process to process (PYTHONHASHSEED)."""
    return sorted(cond.atoms(sp.core.relational.Relational), key=sp.default_sort_key)


def _edges(ctx, pieces):
    out = []
    for _, cond in pieces:
        out += [c for c in _thresholds(ctx, cond) if c not in out]
    return out



# ------------------------------------------------------------------ geometry, warnings
def geometry(ctx, cases, boundary, entangled):
    sp = ctx.sp
    weights = [c["weight"] for c in cases]
    if all(sp.sympify(w) == 1 for w in weights):
        return "none"
    if entangled:
        return "advantage-entangled"
    if all(w.is_number for w in weights) and len({float(w) for w in weights}) == 2:
        div = {float(c["weight"]) for c in cases if c["direction"] == "diverging"}
        conv = {float(c["weight"]) for c in cases if c["direction"] == "converging"}
        if len(div) == 1 and len(conv) == 1 and div != conv:
            return "two-level"
    rs = [e for side in boundary.values() for e in side["r"]]
    pis = [e for side in boundary.values() for e in side["pi"]]
    numeric = [b["where"] for side in boundary.values() for b in side["numeric"]]
    if not rs and not numeric:
        return "other"
    if all(ctx.mu not in e.free_symbols for e in rs) and all(w.startswith("r ≈") for w in numeric):
        return "ratio"
    if any(isinstance(e, sp.Eq) for e in rs):
        # an implicit boundary: its geometry is where the arbiter located it
        where = [w for side in boundary.values() for w in side["where"]] + numeric
        if where and all(w.startswith("r ≈") for w in where):
            return "ratio"
        if where and all(w.startswith("π ≈ μ") for w in where):
            return "binary-tv"
        return "other"
    if all(ctx.mu not in sp.expand(p - ctx.mu).free_symbols for p in pis) and \
            all(w.startswith("π ≈ μ") for w in numeric):
        return "binary-tv"
    return "other"



def numeric_geometry(arb, boundary) -> str:
    """The geometry from the arbiter alone (no derived weight): w ≡ 1, or by where the
    numerically found boundaries lie."""
    np = arb.np
    if arb.valid.any() and np.all(arb.W[arb.valid] == 1):
        return "none"
    where = [b["where"] for side in boundary.values() for b in side["numeric"]]
    if where and all(w.startswith("r ≈") for w in where):
        return "ratio"
    if where and all(w.startswith("π ≈ μ") for w in where):
        return "binary-tv"
    return "other"
