"""Numeric helpers for the symbolic side: a vectorized evaluator of the SymPy expressions
the derivation produces, the derived weight assembled from its four cases, its sampled
range and continuity (the claims the arbiter then checks), and the finite-difference
self-check of a weight against the objective's own float rules."""
from __future__ import annotations

import functools

from openrlhf_drpo.analysis.budgets import BUDGET, size

# ------------------------------------------------------------------ numerics
def numpy_fn(args, expr):
    """A vectorized evaluator for the small expressions the analysis produces. SymPy's
    lambdify would do, but its first call imports printer modules for ~0.3 s. The expression
    is compiled on the first call into a flat list of numpy steps, one per distinct
    subexpression (walking SymPy's tree on every call, asking its assumptions at each node,
    cost trust_the_batch a third of its time); the steps are the walk's own operations, in its
    order, so the values are the same to the bit."""
    import numpy as np
    plan = []

    def run(values):
        if not plan:
            plan.append(_compile(args, expr))
        steps, boolean = plan[0]
        slots, marks = list(values), []
        shapes = [np.shape(v) for v in values]
        for fn, ins, done in steps:
            slots.append(fn(marks, shapes, *[slots[k] for k in ins]))
            for k in done:      # freed after its last use, as the walk freed its temporaries:
                slots[k] = None     # 37 live arrays of 160 KB made every allocation a fresh mmap
        out = np.asarray(slots[-1], dtype=bool if boolean else float)
        return out, functools.reduce(np.logical_or, marks, False)

    def f(*values):
        with np.errstate(all="ignore"):
            values = [np.asarray(v, dtype=float) for v in values]
            out, left = run(values)
            # Where an intermediate left the doubles (e^(r/2) past r ≈ 1419 over a product that
            # has not), evaluate again in extended precision: a right formula must not read 0
            # or nan where the objective's own float rules give a finite w. Only an overflow:
            # a nan of a domain error (√ of a negative, in a piece not taken) is one in any
            # precision, and evaluating those again cost trust_the_batch a quarter of its time.
            if out.dtype == float and np.any(left):
                shape = np.broadcast_shapes(out.shape, np.shape(left), *(v.shape for v in values))
                out, left = np.array(np.broadcast_to(out, shape)), np.broadcast_to(left, shape)
                out[left] = run([np.broadcast_to(v, shape)[left].astype(np.longdouble) for v in values])[0]
            return out
    return f


def _compile(args, expr):
    """(steps, boolean): each step (fn(marks, shapes, *inputs), input slots, the slots used last
    there) appends one slot after the arguments' slots; fn records in marks where a value it computes is infinite
    (an intermediate that left the doubles). The last slot is the expression's value."""
    import numpy as np
    import sympy as sp
    unary = _unary_functions(sp)
    rel = {sp.Lt: np.less, sp.Le: np.less_equal, sp.Gt: np.greater, sp.Ge: np.greater_equal,
           sp.Eq: np.equal, sp.Ne: np.not_equal}
    slot = {a: k for k, a in enumerate(args)}
    steps = []

    def emit(fn, ins):
        steps.append((fn, ins))
        return len(args) + len(steps) - 1

    def mark(marks, x):     # an overflow: a nan from finite values (√(−1)) is one in any precision
        marks.append(np.isinf(x))
        return x

    def add(marks, shape, *xs):
        return mark(marks, sum(xs))

    def mul(marks, shape, *xs):
        out = 1.0
        for x in xs:
            out = mark(marks, out * x)
        return out

    def piecewise(marks, shapes, *xs):
        conds, vals = xs[1::2], xs[::2]
        shape = np.broadcast_shapes(*(np.shape(x) for x in xs), *shapes)
        return np.select([np.broadcast_to(c, shape) for c in conds], [np.broadcast_to(v, shape) for v in vals],
                         default=np.nan)

    def const(v):
        return lambda marks, shape: v

    def reduce(f):
        return lambda marks, shape, *xs: functools.reduce(f, xs)

    def node(e):
        if e in slot:
            return slot[e]
        if e is sp.true or e is sp.false:
            fn, ins = const(bool(e)), []
        elif e in (sp.zoo, sp.nan, sp.I) or (e.is_number and e.is_extended_real is False):
            fn, ins = const(np.nan), []     # complex, or undefined: not a real value of w
        elif e.is_Number or e.is_NumberSymbol:      # 2/5, 1e200, E, pi, oo
            fn, ins = const(float(e)), []
        elif e.is_Add:
            fn, ins = add, [node(a) for a in e.args]
        elif e.is_Mul:
            fn, ins = mul, [node(a) for a in e.args]
        elif e.is_Pow:
            fn, ins = (lambda marks, shape, b, x: mark(marks, np.power(b, x))), [node(e.base), node(e.exp)]
        elif e.func in unary:
            fn, ins = (lambda marks, shape, x, u=unary[e.func]: mark(marks, u(x))), [node(e.args[0])]
        elif isinstance(e, (sp.Min, sp.Max)):
            fn, ins = reduce(np.minimum if isinstance(e, sp.Min) else np.maximum), [node(a) for a in e.args]
        elif e.func in rel:
            fn, ins = (lambda marks, shape, x, y, f=rel[e.func]: f(x, y)), [node(e.lhs), node(e.rhs)]
        elif isinstance(e, sp.And):     # functools.reduce broadcasts operands of different shapes
            fn, ins = reduce(np.logical_and), [node(a) for a in e.args]
        elif isinstance(e, sp.Or):
            fn, ins = reduce(np.logical_or), [node(a) for a in e.args]
        elif isinstance(e, sp.Not):
            fn, ins = (lambda marks, shape, x: np.logical_not(x)), [node(e.args[0])]
        elif isinstance(e, sp.ITE):
            fn, ins = (lambda marks, shape, c, x, y: np.where(c, x, y)), [node(a) for a in e.args]
        elif isinstance(e, sp.Piecewise):
            fn, ins = piecewise, [node(x) for pair in e.args for x in pair]
        else:
            raise NotImplementedError(e.func)   # e.g. LambertW: callers fall back to SymPy
        slot[e] = emit(fn, ins)
        return slot[e]

    emit(lambda marks, shapes, x: x, [node(expr)])
    last = {k: i for i, (_, ins) in enumerate(steps) for k in ins}
    steps = [(fn, ins, [k for k in set(ins) if last[k] == i and k >= len(args)]) for i, (fn, ins) in enumerate(steps)]
    # a bare Symbol is a Boolean to SymPy too: w = r is a number
    return steps, isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Symbol)


@functools.lru_cache(maxsize=1)
def _unary_functions(sp):
    """SymPy function -> numpy lowering, from the OPS rows whose SymPy lowering is one
    function application (log, exp, Abs, sign, erf, atan, ...): one place per op."""
    from dsl.operations import OPS
    x, out = sp.Symbol("x"), {}
    for op in OPS.values():
        if op.arity == (1, 1) and op.args_kind == "num" and not op.reduce:
            e = op.sympy(sp, x)
            if isinstance(e, sp.Function) and e.args == (x,):
                out[e.func] = eval(f"lambda x: {op.np('x')}", {"np": __import__("numpy"), "math": __import__("math")})
    return out


class Numeric:
    """Range and continuity of w over 0 < μ ≤ 1, 0 < π ≤ 1, by dense sampling, with exact
    values snapped from the domain's corners where a piece's formula reaches them."""

    def __init__(self, ctx, w, cases, entangled):
        import numpy as np
        self.np, self.ctx, self.cases, self.entangled = np, ctx, cases, entangled
        self.f = w

    def _grid(self, smallest):
        np = self.np
        axis = np.unique(np.concatenate([np.logspace(np.log10(smallest), 0, 90), np.linspace(0.01, 1, 60)]))
        mu, pi = np.meshgrid(axis, axis, indexing="ij")
        return mu.ravel(), pi.ravel()

    def _values(self, smallest):
        np = self.np
        mu, pi = self._grid(smallest)
        # |A| is sampled too when w depends on it, and refined along with μ
        k = -np.log10(smallest) / 2
        # (with the arbiter's quarter decades, every other one: a band such as 2 ≤ |A| ≤ 20 lies between
        # the wide grid's own 13 values)
        from openrlhf_drpo.analysis.numeric.arbiter import DENSE_MAGNITUDES
        mags = np.union1d(np.logspace(-k, k, 13), DENSE_MAGNITUDES[::2]) if self.entangled else np.array([1.0])
        vals = []
        with np.errstate(all="ignore"):
            for sign in (1.0, -1.0):
                for m in mags:
                    v = np.broadcast_to(np.asarray(self.f(pi / mu, mu, sign * m), dtype=float), mu.shape)
                    vals.append(v[np.isfinite(v)])
        return np.concatenate(vals)

    def weight_range(self, corners=()):
        """[lo, hi] (None: unbounded) and whether each side is exact. corners: the limits
        the tails show at the domain's corners (0 where w decays), which the closure holds."""
        coarse, fine = self._values(1e-6), self._values(1e-16)     # as far as the arbiter looks (r to 1e-16)
        if not coarse.size or not fine.size:    # w is nowhere a finite double (e.g. 1e400·r·A)
            return None, [False, False]
        lo_c, hi_c, lo_f, hi_f = coarse.min(), coarse.max(), fine.min(), fine.max()
        # A side that keeps growing as the grid approaches the domain's edge is unbounded; one
        # that keeps shrinking toward 0 (r^0.3 as r → 0) is not: its end is the corners' limit.
        lo = None if (lo_f < lo_c - 1e-3 * max(1.0, abs(lo_c)) and lo_f < 0) or abs(lo_f) > 1e8 else lo_f
        hi = None if (hi_f > hi_c + 1e-3 * max(1.0, abs(hi_c)) and hi_f > 0) or abs(hi_f) > 1e8 else hi_f
        for v in corners:
            lo = None if lo is None else min(lo, v)
            hi = None if hi is None else max(hi, v)
        at_corners = self._at_corners()
        candidates = [float(v) for _, _, v in at_corners if v is not None and v.is_number and v.is_finite and v.is_real]
        tails, seen = self._tail_values(at_corners), []

        def limits():       # each limit taken once, on first demand; a later search replays the kept ones
            yield from seen
            for c in tails:
                seen.append(c)
                yield c
        exact = [True, True]
        out = []
        for k, v in enumerate((lo, hi)):
            if v is None:
                out.append(None)
                continue
            snap = [c for c in candidates if abs(c - v) <= 1e-5 * max(1.0, abs(c))]
            if not snap:        # limits cost SymPy time: taken only until one explains the extreme
                hit = next((c for c in limits() if abs(c - v) <= 1e-5 * max(1.0, abs(c))), None)
                snap = [] if hit is None else [hit]
            if snap:
                out.append(snap[0])
            else:
                exact[k] = False
                out.append(float(f"{v:.6g}"))
        return out, exact

    def _at_corners(self):
        """(piece formula over μ and π, corner, its value there or None) for every piece and
        corner of the closed (μ, π) square: each substitution once, for the exact values and
        the limits alike."""
        ctx = self.ctx
        return [(e, corner, ctx.limited("evaluating a corner", lambda: e.subs(corner))) for e, corner in self._corners()]

    def _tail_values(self, at_corners):
        """Limits at the corners r → ∞ (μ → 0) and r → 0 (π → 0) where substituting reads ∞ − ∞
        or e^(−∞): 1/(4r² − 8r + 5) and e^(−(r − 1)²) tend to 0 there. Within budgets: a limit
        is taken of a formula up to BUDGET["limit"] nodes, and at most BUDGET["limits"] of them."""
        ctx, sp, done, taken = self.ctx, self.ctx.sp, set(), 0
        for e, corner, v in at_corners:
            if (corner[ctx.pi] == 1 and corner[ctx.mu] == 1) or (e, corner[ctx.mu]) in done:
                continue
            done.add((e, corner[ctx.mu]))
            if v is None or not v.is_number or v.is_finite:
                continue        # a finite value is an exact candidate already
            x = ctx.mu if corner[ctx.mu] == 0 else ctx.pi
            f = e.subs({y: c for y, c in corner.items() if y != x})
            if size(f) > BUDGET["limit"] or taken >= BUDGET["limits"]:
                continue        # left to the sampled range
            taken += 1
            v = ctx.limited("a limit at a corner", lambda: sp.limit(f, x, 0, "+"), None)
            if v is not None and v.is_number and v.is_finite and v.is_real:
                yield float(v)

    def _corners(self):
        """(piece formula over μ and π, corner) for every piece and corner of the closed square."""
        ctx, sp = self.ctx, self.ctx.sp
        if self.entangled:
            return
        for case in self.cases:
            s = case["_s"]
            for expr, _ in case["_pieces"]:
                e = sp.expand(expr.subs(ctx.t, s * (ctx.pi / ctx.mu - 1)))
                for m0, p0 in ((0, 1), (1, 0), (1, 1)):
                    yield e, {ctx.mu: m0, ctx.pi: p0}


def case_dispatch(ctx, cases):
    """Vectorized w(r, μ, A) assembled from the four case weights: what the numeric checks
    (range, continuity, the finite-difference self-check) evaluate, so they test the
    reported cases themselves."""
    import numpy as np
    fns = [(1 if c["advantage"] == "positive" else -1, c["direction"],
            numpy_fn([ctx.r, ctx.mu, ctx.A], c["weight"])) for c in cases]

    def w(r, mu, A):
        r, mu, A = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (r, mu, A)))
        out = np.full(r.shape, np.nan)
        for sign, direction, f in fns:
            moving_away = sign * (r - 1) > 0
            m = (sign * A > 0) & (moving_away if direction == "diverging" else ~moving_away)
            if m.any():
                with np.errstate(all="ignore"):
                    out[m] = np.broadcast_to(np.asarray(f(r[m], mu[m], A[m]), dtype=float), r[m].shape)
        return out
    return w


# ------------------------------------------------------------------ self-check
def self_check(obj, w, n=64, seed=0) -> dict:
    """Central finite differences of the objective in r against w·A at random points.
    The objective is evaluated by the IR's own float rules (never SymPy), with stop-
    gradients held at their base-point values; points that straddle a kink are skipped."""
    import numpy as np
    from dsl.walks import numpy_plan
    params = {k: float(v) for k, v in obj.params.items()}
    rng = np.random.default_rng(seed)
    mu, pi = rng.uniform(0.02, 1.0, size=(2, 8 * n))
    A = rng.choice([-1.0, 1.0], 8 * n) * rng.uniform(0.1, 3.0, 8 * n)
    r = pi / mu
    h = 1e-6 * np.maximum(r, 1.0)
    run, frozen = numpy_plan(obj.expr), {}

    def ell(x):
        return np.broadcast_to(run({"r": x, "mu": mu, "pi": mu * x, "A": A, **params}, frozen)[0], x.shape)
    f0 = ell(r)         # fills the stop-gradient values first
    fp, fm = ell(r + h), ell(r - h)
    with np.errstate(all="ignore"):
        expected = np.broadcast_to(np.asarray(w(r, mu, A), dtype=float), r.shape) * A
        fwd, bwd = (fp - f0) / h, (f0 - fm) / h
        ok = np.isfinite(fwd) & np.isfinite(bwd) & np.isfinite(expected)
        ok &= np.abs(fwd - bwd) <= 1e-3 * np.maximum(1.0, np.abs(fwd))      # a kink lies within h: skip
        ok &= np.cumsum(ok) <= n
        err = np.abs((fwd + bwd) / 2 - expected) / np.maximum(1.0, np.abs(expected))
    checked = int(ok.sum())
    worst = float(err[ok].max()) if checked else 0.0
    # too few finite points (an objective that overflows doubles, say) confirms nothing
    status = "failed" if worst >= 1e-4 else "passed" if checked >= n // 2 else "unconfirmed"
    return {"points": checked, "max_rel_error": worst, "passed": status == "passed", "status": status}
