"""What an objective does to each token's gradient, derived from the IR.

With μ fixed, ∇r = r∇log π, so a per-token objective ℓ(r, μ, A) has gradient
(∂ℓ/∂r)·r·∇log π and induced weight w = (∂ℓ/∂r)/A relative to the surrogate r·A.
∂ℓ/∂r comes from the IR's own derivative rules (dsl.ir.derivative), the same ones the
torch compiler uses. Each case (sign of A × direction of the update) substitutes signed
positive symbols, A = ±a and r = 1 ± t, so SymPy can settle Piecewise conditions cheaply
instead of running its general inequality solvers, which can take seconds or recurse.
Every SymPy call runs under a time limit with a numeric fallback that is reported.
"""
from __future__ import annotations

import functools
import math
import signal
import time
import threading
from contextlib import contextmanager

from .arbiter import Arbiter, on_policy, on_policy_warnings
from .confirm import check_weight, compare_range, confirm_boundaries, domain_warnings
from .ir import derivative, to_sympy
from .parser import Objective

SIGNS = (("positive", 1), ("negative", -1))
DIRECTIONS = ("diverging", "converging")
SYMPY_SECONDS = 1.0      # any one SymPy step
ANALYSIS_SECONDS = 8.0   # all SymPy steps of one analysis; past it, every step takes its fallback


class _Timeout(Exception):
    pass


_ACTIVE = []


@contextmanager
def _time_limit(seconds):
    # SIGALRM interrupts pure-Python SymPy work. Nested limits run under the outer one;
    # off the main thread there is no limit.
    if _ACTIVE or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise _Timeout()
    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    _ACTIVE.append(1)
    try:
        yield
    finally:
        _ACTIVE.pop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _Ctx:
    """SymPy symbols and the notes a run collects (fallbacks taken, etc.)."""

    def __init__(self, obj: Objective):
        import sympy as sp
        self.sp = sp
        self.obj = obj
        self.r, self.mu, self.pi = sp.symbols("r mu pi", positive=True)
        self.A = sp.Symbol("A", real=True, nonzero=True)
        self.a, self.t = sp.symbols("a t", positive=True)
        self.param_syms = {k: sp.Symbol(k, positive=True) if v > 0 else sp.Symbol(k, real=True)
                           for k, v in obj.params.items()}
        self.param_vals = {k: sp.Rational(v.numerator, v.denominator) for k, v in obj.params.items()}
        self.dl = derivative(obj.expr)
        self.notes: list[str] = []
        self.deadline = time.monotonic() + ANALYSIS_SECONDS

    def tidy(self, e):
        return self.limited("simplifying", lambda: _tidy(self.sp, e), e)

    def env(self, symbolic: bool):
        params = self.param_syms if symbolic else self.param_vals
        return {"r": self.r, "mu": self.mu, "pi": self.mu * self.r, "A": self.A, **params}

    def limited(self, what, fn, default=None):
        seconds = min(SYMPY_SECONDS, self.deadline - time.monotonic())
        if seconds <= 0:
            note = f"{what}: the analysis's {ANALYSIS_SECONDS:g} s budget is spent; used the fallback"
            if note not in self.notes:
                self.notes.append(note)
            return default
        try:
            with _time_limit(seconds):
                return fn()
        except _Timeout:
            self.notes.append(f"{what}: SymPy took over {seconds:.2g} s; used the fallback")
        except Exception as e:  # SymPy raises many types (NotImplementedError, RecursionError, ...)
            self.notes.append(f"{what}: SymPy failed ({type(e).__name__}); used the fallback")
        return default


# ------------------------------------------------------------------ the weight
def _tidy(sp, e):
    """Cheap canonical form: 1 - 2·μ·(r - 1)/25 rather than an expanded sum."""
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*[(_tidy(sp, x), c) for x, c in e.args])
    e = sp.cancel(e) if e.is_rational_function() else e
    const, rest = sp.expand(e).as_coeff_Add()
    return const + sp.factor_terms(rest)


def _full_weight(ctx: _Ctx, cases):
    """w over r, mu, A and the parameter names. Smooth objectives keep their parameters
    symbolic; a piecewise one is assembled from its four case weights (at parameter values),
    since folding nested Piecewise symbolically can take SymPy seconds."""
    sp = ctx.sp
    if not any(n.op in ("min", "max", "clip", "ind") for n in ctx.dl.walk()):
        dl = to_sympy(ctx.dl, sp, ctx.env(True))
        w = dl.subs(sp.Abs(ctx.A), ctx.A * sp.sign(ctx.A)) / ctx.A
        return ctx.limited("simplifying w", lambda: _tidy(sp, w), w)
    by = {(c["advantage"], c["direction"]): c["weight"] for c in cases}
    A, r = ctx.A, ctx.r
    return sp.Piecewise((by["positive", "diverging"], (A > 0) & (r > 1)), (by["positive", "converging"], A > 0),
                        (by["negative", "diverging"], r < 1), (by["negative", "converging"], True))


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
        sp = self.ctx.sp
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
        if out in (sp.true, sp.false) or out.free_symbols != {self.ctx.t}:
            return out
        return self.settle(out)

    def settle(self, cond):
        """A condition in t alone is constant between its thresholds: evaluate it at each
        threshold and between them, then rebuild the shortest equivalent (t ≤ c, t > c, ...).
        (SymPy's as_set does the same job about a hundred times slower.)"""
        sp, t = self.ctx.sp, self.ctx.t
        cuts = sorted({float(rel.rhs) for rel in cond.atoms(sp.core.relational.Relational)
                       if rel.lhs == t and rel.rhs.is_number})
        lo, hi = 0.0, float(self.tmax) if self.tmax is not None else math.inf
        cuts = [c for c in cuts if lo < c < hi]
        if any(rel.lhs != t or not rel.rhs.is_number for rel in cond.atoms(sp.core.relational.Relational)):
            return cond
        edges = [lo] + cuts + [hi]
        probes = []
        for i in range(len(edges) - 1):
            a, b = edges[i], edges[i + 1]
            probes.append((a + b) / 2 if math.isfinite(b) else a + 1.0)
            if i < len(cuts):
                probes.append(cuts[i])
        truth = [bool(cond.xreplace({t: sp.Float(x)})) for x in probes]
        if all(truth):
            return sp.true
        if not any(truth):
            return sp.false
        exact = {float(rel.rhs): rel.rhs for rel in cond.atoms(sp.core.relational.Relational)}
        if len(cuts) >= 1:
            k = truth.index(not truth[0])      # first change
            if all(v == truth[0] for v in truth[:k]) and all(v != truth[0] for v in truth[k:]):
                if k % 2 == 1:                 # the change happens at a threshold itself
                    c, at_cut_matches_start = exact[cuts[k // 2]], False
                else:
                    c, at_cut_matches_start = exact[cuts[k // 2 - 1]], True
                if truth[0]:
                    return sp.Le(t, c) if at_cut_matches_start else sp.Lt(t, c)
                return sp.Gt(t, c) if at_cut_matches_start else sp.Ge(t, c)
        return cond

    def fold(self, e, cond=None):
        """[(expr, condition)] without Piecewise, conditions settled and mutually exclusive.
        SymPy's piecewise_fold does this too, but calls simplify_logic, which is slow."""
        sp = self.ctx.sp
        cond = sp.true if cond is None else cond
        found = e.atoms(sp.Piecewise)
        if not found:
            return [(e, cond)]
        P = next(iter(found))
        out, before = [], []
        for x, c in P.args:   # first match wins: branch i also excludes branches 1..i-1
            cc = self.cond(sp.And(cond, *before, c))
            before.append(sp.Not(c))
            if cc != sp.false:
                out += self.fold(e.xreplace({P: x}), cc)
        return out

    def relation(self, e):
        sp, t = self.ctx.sp, self.ctx.t
        if not isinstance(e, sp.core.relational.Relational):
            return e
        h = e.lhs - e.rhs
        if h.has(sp.Piecewise):   # distribute: h_i ⋚ 0 where piece i holds
            return self.cond(sp.Or(*[sp.And(c, self.relation(e.func(x, 0))) for x, c in self.fold(h)]))
        h = sp.expand(h)
        if t not in h.free_symbols:
            return e.func(h, 0)
        poly = h.as_poly(t)
        if poly is None or poly.degree() != 1:
            return e.func(h, 0)
        c1, c0 = poly.all_coeffs()
        flip = {sp.Lt: sp.Gt, sp.Le: sp.Ge, sp.Gt: sp.Lt, sp.Ge: sp.Le, sp.Eq: sp.Eq, sp.Ne: sp.Ne}
        func = e.func if c1.is_positive else flip[e.func] if c1.is_negative else None
        if func is None:
            return e.func(h, 0)
        return func(t, sp.cancel(-c0 / c1))


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


def _as_piecewise(sp, pieces):
    if len(pieces) == 1:
        return pieces[0][0]
    return sp.Piecewise(*pieces[:-1], (pieces[-1][0], True))


# ------------------------------------------------------------------ analysis
def analyze(obj: Objective) -> dict:
    ctx = _Ctx(obj)
    sp = ctx.sp
    cases, candidates, breaks = [], {}, {}
    entangled = False
    for adv, sign in SIGNS:
        found = [_candidate(ctx, sp.Integer(1), "seam", probe=False)]      # r = 1, where the two cases meet
        breaks[adv] = []
        for direction in DIRECTIONS:
            s, tmax, pieces = _case_weight(ctx, sign, direction)
            entangled |= any(ctx.a in (e.free_symbols | c.free_symbols) for e, c in pieces)
            back = {ctx.t: s * (ctx.r - 1), ctx.a: sign * ctx.A}
            shown = _as_piecewise(sp, [(ctx.tidy(e.subs(back)), c.subs(back)) for e, c in pieces])
            cases.append({"advantage": adv, "direction": direction, "weight": shown,
                          "_pieces": pieces, "_s": s, "_tmax": tmax})
            a_back = {ctx.a: sign * ctx.A}
            for zero in _zeros(ctx, pieces, tmax):
                if zero[0] == "implicit":
                    found.append(_candidate(ctx, sp.Eq(zero[1].subs(ctx.t, s * (ctx.r - 1)).subs(a_back), 0),
                                            "implicit"))
                elif zero[0].is_real is not False and not isinstance(zero[0], sp.logic.boolalg.Boolean):
                    found.append(_candidate(ctx, ctx.tidy(1 + s * zero[0]).subs(a_back), "zero"))
            found += [_candidate(ctx, ctx.tidy(1 + s * e).subs(a_back), "edge", probe=False)
                      for e in _edges(ctx, pieces)]
            breaks[adv] += [(s, e) for e in _edges(ctx, pieces)]
        candidates[adv] = [c for c in found if c is not None]
    w_values = _case_dispatch(ctx, cases)
    result = {
        "name": obj.name, "path": obj.path, "description": obj.description,
        "params": {k: float(v) for k, v in obj.params.items()},
        "options": dict(obj.options),
        "objective": obj.canonical().splitlines()[-1],
        "weight": _full_weight(ctx, cases), "cases": cases,
    }
    arb = Arbiter(obj)
    facts = arb.facts()
    result["boundary"], notes = confirm_boundaries(ctx, arb, facts, candidates)
    ctx.notes += notes
    result["reachable"] = {adv: any(b["reachable"]) or bool(b["numeric"]) for adv, b in result["boundary"].items()}
    num = _Numeric(ctx, w_values, cases, entangled)
    sampled, exact_range = num.weight_range()
    claim_smooth = num.continuous(breaks)
    weight_range, range_held = compare_range(sampled, facts["range"])
    result["weight_range"] = weight_range or [None, None]
    result["bounded"] = None if weight_range is None else None not in weight_range     # None: unknown
    result["smooth"] = facts["continuous"]
    result["geometry"] = _geometry(ctx, cases, result["boundary"], entangled)
    result["self_check"] = self_check(ctx, w_values)
    result["on_policy"] = on_policy(obj)
    result["arbiter"] = {
        "points": facts["points"], "magnitudes": list(arb.magnitudes), "weight": check_weight(arb, w_values),
        "boundary": ("numeric" if any(b["numeric"] for b in result["boundary"].values()) else "unconfirmed"
                     if any("unconfirmed" in k for b in result["boundary"].values() for k in b["kind"]) else "confirmed"),
        "range": "confirmed" if range_held else "disagrees", "range_derived": sampled,
        "smooth": "confirmed" if claim_smooth == facts["continuous"] else "disagrees",
        "poles": any(facts[adv]["poles"] for adv, _ in SIGNS),
    }
    result["warnings"] = (_warnings(ctx, result, exact_range if range_held else [False, False])
                          + domain_warnings(facts) + on_policy_warnings(result["on_policy"]))
    result["notes"] = ctx.notes
    result["_w"] = w_values      # vectorized w(r, μ, A), for plots and callers' own checks
    result["_arbiter"] = arb
    return result


def _candidate(ctx, r_star, source, probe=True):
    """A place the symbolic path says w may change sign, as (r*, π*, g, explicit): g(r, μ, A)
    is 0 there, and explicit(μ, A) gives r* for a closed-form zero of w, which the arbiter
    also probes outside the domain (an edge or r = 1 is only a place w might jump)."""
    sp = ctx.sp
    if isinstance(r_star, sp.logic.boolalg.BooleanAtom):    # an implicit edge that is constant: no place
        return None
    if isinstance(r_star, sp.Eq):
        h = r_star.lhs - r_star.rhs
        try:
            g = _numpy_fn([ctx.r, ctx.mu, ctx.A], h)
        except Exception:       # noqa: BLE001 - an implicit edge numpy cannot build: left to the arbiter
            return None
        return r_star, (lambda: sp.Eq(h.subs(ctx.r, ctx.pi / ctx.mu), 0)), g, None
    explicit = _numpy_fn([ctx.mu, ctx.A], r_star)
    # π* is built only for a candidate the arbiter keeps: tidying each one costs SymPy time
    return r_star, (lambda: ctx.tidy(ctx.mu * r_star)), (lambda r, mu, A: r - explicit(mu, A)), \
        explicit if probe else None


def _case_dispatch(ctx, cases):
    """Vectorized w(r, μ, A) assembled from the four case weights: what the numeric checks
    (range, continuity, the finite-difference self-check) evaluate, so they test the
    reported cases themselves."""
    import numpy as np
    fns = [(1 if c["advantage"] == "positive" else -1, c["direction"],
            _numpy_fn([ctx.r, ctx.mu, ctx.A], c["weight"])) for c in cases]

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
            out += [("implicit", rel.lhs - rel.rhs, sp.true) for rel in eff.atoms(sp.core.relational.Relational)
                    if t in rel.free_symbols and not _is_threshold(ctx, rel)]
            continue
        if t not in expr.free_symbols:
            continue
        if not expr.is_rational_function(t):   # transcendental: an implicit boundary, found numerically
            out.append(("implicit", expr, cond))
            continue
        sols = ctx.limited("solving w = 0", lambda: _solve_rational(sp, expr, t), None)
        if sols is None:
            out.append(("implicit", expr, cond))
            continue
        for sol in sols or []:
            if sol.is_real is False or sol.is_nonpositive or (tmax is not None and (sol - tmax).is_nonnegative):
                continue
            out.append((sp.cancel(sol), cond))
    return out


def _solve_rational(sp, expr, t):
    """Zeros in t of a rational function: the numerator's roots, in closed form. (sp.solve
    gives the same, but its first call imports the solvers package, ~0.9 s.)"""
    num, den = sp.fraction(sp.together(expr))
    poly = sp.Poly(num, t)
    coeffs = poly.all_coeffs()
    if poly.degree() == 1:
        roots = [-coeffs[1] / coeffs[0]]
    elif poly.degree() == 2:
        a2, b, c = coeffs
        disc = sp.sqrt(b * b - 4 * a2 * c)
        roots = [(-b + disc) / (2 * a2), (-b - disc) / (2 * a2)]
    elif poly.degree() <= 0:
        return []
    else:
        found = sp.roots(poly)
        if sum(found.values()) != poly.degree():
            raise NotImplementedError("roots not in closed form")
        roots = list(found)
    return [x for x in roots if den.subs(t, x) != 0]


def _effective(ctx, pieces, i):
    sp = ctx.sp
    prev = [sp.Not(c) for _, c in pieces[:i]]
    return sp.And(*prev, pieces[i][1]) if prev else pieces[i][1]


def _is_threshold(ctx, rel) -> bool:
    return rel.lhs == ctx.t and ctx.t not in rel.rhs.free_symbols


def _thresholds(ctx, cond) -> list:
    """Every c of a settled relation t ⋚ c inside a condition."""
    return [rel.rhs for rel in cond.atoms(ctx.sp.core.relational.Relational) if _is_threshold(ctx, rel)]


def _edges(ctx, pieces):
    out = []
    for _, cond in pieces:
        out += [c for c in _thresholds(ctx, cond) if c not in out]
    return out



# ------------------------------------------------------------------ numerics
def _numpy_fn(args, expr):
    """A vectorized evaluator for the small expressions the analysis produces. SymPy's
    lambdify would do, but its first call imports printer modules for ~0.3 s."""
    import numpy as np
    import sympy as sp
    unary = {sp.log: np.log, sp.exp: np.exp, sp.sign: np.sign, sp.Abs: np.abs}
    rel = {sp.Lt: np.less, sp.Le: np.less_equal, sp.Gt: np.greater, sp.Ge: np.greater_equal,
           sp.Eq: np.equal, sp.Ne: np.not_equal}

    def ev(e, env):
        if e in env:
            return env[e]
        if e is sp.true or e is sp.false:
            return bool(e)
        if e in (sp.zoo, sp.nan, sp.I) or (e.is_number and e.is_extended_real is False):
            return np.nan           # complex, or undefined: not a real value of w
        if e.is_Number or e.is_NumberSymbol:      # 2/5, 1e200, E, pi, oo
            return float(e)
        if e.is_Add:
            return sum(ev(a, env) for a in e.args)
        if e.is_Mul:
            out = 1.0
            for a in e.args:
                out = out * ev(a, env)
            return out
        if e.is_Pow:
            return np.power(ev(e.base, env), ev(e.exp, env))
        if e.func in unary:
            return unary[e.func](ev(e.args[0], env))
        if isinstance(e, (sp.Min, sp.Max)):
            return functools.reduce(np.minimum if isinstance(e, sp.Min) else np.maximum, [ev(a, env) for a in e.args])
        if e.func in rel:
            return rel[e.func](ev(e.lhs, env), ev(e.rhs, env))
        if isinstance(e, sp.And):     # functools.reduce broadcasts operands of different shapes
            return functools.reduce(np.logical_and, [ev(a, env) for a in e.args])
        if isinstance(e, sp.Or):
            return functools.reduce(np.logical_or, [ev(a, env) for a in e.args])
        if isinstance(e, sp.Not):
            return np.logical_not(ev(e.args[0], env))
        if isinstance(e, sp.ITE):
            return np.where(ev(e.args[0], env), ev(e.args[1], env), ev(e.args[2], env))
        if isinstance(e, sp.Piecewise):
            conds = [ev(c, env) for _, c in e.args]
            vals = [ev(x, env) for x, _ in e.args]
            shape = np.broadcast_shapes(*(np.shape(x) for x in conds + vals), *(np.shape(v) for v in env.values()))
            conds = [np.broadcast_to(c, shape) for c in conds]
            vals = [np.broadcast_to(v, shape) for v in vals]
            return np.select(conds, vals, default=np.nan)
        raise NotImplementedError(e.func)   # e.g. LambertW: callers fall back to SymPy

    def f(*values):
        with np.errstate(all="ignore"):
            env = dict(zip(args, (np.asarray(v, dtype=float) for v in values)))
            # a bare Symbol is a Boolean to SymPy too: w = r is a number
            boolean = isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Symbol)
            return np.asarray(ev(expr, env), dtype=bool if boolean else float)
    return f



class _Numeric:
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
        mags = np.logspace(-k, k, 13) if self.entangled else np.array([1.0])
        vals = []
        with np.errstate(all="ignore"):
            for sign in (1.0, -1.0):
                for m in mags:
                    v = np.broadcast_to(np.asarray(self.f(pi / mu, mu, sign * m), dtype=float), mu.shape)
                    vals.append(v[np.isfinite(v)])
        return np.concatenate(vals)

    def weight_range(self):
        coarse, fine = self._values(1e-6), self._values(1e-12)
        if not coarse.size or not fine.size:    # w is nowhere a finite double (e.g. 1e400·r·A)
            return None, [False, False]
        lo_c, hi_c, lo_f, hi_f = coarse.min(), coarse.max(), fine.min(), fine.max()
        # A side that keeps growing as the grid approaches the domain's edge is unbounded.
        lo = None if lo_f < lo_c - 1e-3 * max(1.0, abs(lo_c)) or abs(lo_f) > 1e8 else lo_f
        hi = None if hi_f > hi_c + 1e-3 * max(1.0, abs(hi_c)) or abs(hi_f) > 1e8 else hi_f
        candidates = self._corner_values()
        exact = [True, True]
        out = []
        for k, v in enumerate((lo, hi)):
            if v is None:
                out.append(None)
                continue
            snap = [c for c in candidates if abs(c - v) <= 1e-5 * max(1.0, abs(c))]
            if snap:
                out.append(snap[0])
            else:
                exact[k] = False
                out.append(float(f"{v:.6g}"))
        return out, exact

    def _corner_values(self):
        """Exact values of every piece's formula at the corners of the closed (μ, π) square."""
        ctx, sp = self.ctx, self.ctx.sp
        values = []
        if self.entangled:
            return values
        for case in self.cases:
            s = case["_s"]
            for expr, _ in case["_pieces"]:
                e = sp.expand(expr.subs(ctx.t, s * (ctx.pi / ctx.mu - 1)))
                for m0, p0 in ((0, 1), (1, 0), (1, 1)):
                    v = ctx.limited("evaluating a corner", lambda: e.subs({ctx.mu: m0, ctx.pi: p0}))
                    if v is not None and v.is_number and v.is_finite and v.is_real:
                        values.append(float(v))
        return values

    def continuous(self, breaks) -> bool:
        """w is continuous in r if it has no jump at r = 1 nor at any piece edge."""
        np, ctx = self.np, self.ctx
        mus = np.array([0.02, 0.1, 0.3, 0.5, 0.77, 1.0])
        mags = np.array([0.3, 1.0, 3.0])
        for sign, adv in ((1.0, "positive"), (-1.0, "negative")):
            for m in mags:
                edges = [np.ones_like(mus)]
                for s, edge in breaks[adv]:
                    try:
                        t0 = _numpy_fn([ctx.mu, ctx.a], edge)(mus, m)
                    except NotImplementedError:     # e.g. LambertW: that edge is not probed
                        continue
                    edges.append(1 + s * np.broadcast_to(np.asarray(t0, dtype=float), mus.shape))
                for r0 in edges:
                    ok = np.isfinite(r0) & (r0 > 0)
                    rr, mm = r0[ok], mus[ok]
                    h = 1e-7 * np.maximum(rr, 1.0)
                    with np.errstate(all="ignore"):
                        lo = np.asarray(self.f(rr - h, mm, sign * m), dtype=float)
                        hi = np.asarray(self.f(rr + h, mm, sign * m), dtype=float)
                    if np.any(np.abs(np.broadcast_to(hi - lo, rr.shape)) > 1e-4):
                        return False
        return True


# ------------------------------------------------------------------ geometry, warnings
def _geometry(ctx, cases, boundary, entangled):
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
        return "other"
    if all(ctx.mu not in sp.expand(p - ctx.mu).free_symbols for p in pis) and \
            all(w.startswith("π ≈ μ") for w in numeric):
        return "binary-tv"
    return "other"


def _warnings(ctx, res, exact_range):
    from .report import _fmt, math_text
    out = []
    lo, hi = res["weight_range"]
    for adv, sign_text in (("positive", "A > 0"), ("negative", "A < 0")):
        b = res["boundary"][adv]
        if not b["pi"] and not b["numeric"]:
            if res["geometry"] != "none":
                out.append(f"no trust-region boundary for {sign_text}: w never reaches 0, so nothing stops the update")
        elif not res["reachable"][adv]:
            shown = ", ".join(f"π = {math_text(p)}" for p in b["pi"])
            out.append(f"the boundary for {sign_text} ({shown}) is unreachable: 0 < π, μ ≤ 1, "
                       f"so w stays within [{_fmt(lo)}, {_fmt(hi)}] and never cancels the gradient")
        elif not all(b["reachable"]):
            shown = ", ".join(f"π = {math_text(p)}" for p, ok in zip(b["pi"], b["reachable"]) if not ok)
            out.append(f"for {sign_text}, the boundary {shown} is unreachable in 0 < π, μ ≤ 1")
        if b["numeric"]:
            out.append(f"for {sign_text}, the numeric check finds w changing sign where the symbolic derivation "
                       "found no boundary: " + "; ".join(f"{x['where']} ({x['kind']})" for x in b["numeric"]))
    if res["bounded"] is None:
        out.append("w is not a finite double at any sampled point: its range is unknown")
    elif not res["bounded"]:
        out.append(f"w is unbounded (range [{_fmt(lo)}, {_fmt(hi)}]): tokens with extreme ratios "
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
    for claim, what in (("range", "range"), ("smooth", "continuity")):
        if res["arbiter"][claim] == "disagrees":
            out.append(f"the symbolic {what} disagreed with the numeric arbiter; the numeric finding is shown")
    if res["self_check"]["status"] == "failed":
        out.append("SELF-CHECK FAILED: the derived weight disagrees with finite differences of the objective")
    elif res["self_check"]["status"] == "unconfirmed":
        out.append("the weight is unconfirmed: too few points where the objective is a finite double to check it")
    return out


# ------------------------------------------------------------------ self-check
def self_check(ctx, w, n=64, seed=0) -> dict:
    """Central finite differences of the objective in r against w·A at random points.
    The objective is evaluated by the IR's own float rules (never SymPy), with stop-
    gradients held at their base-point values; points that straddle a kink are skipped."""
    import numpy as np
    from .ir import evaluate
    params = {k: float(v) for k, v in ctx.obj.params.items()}
    rng = np.random.default_rng(seed)

    def ell(r, mu, A, frozen):
        return evaluate(ctx.obj.expr, {"r": r, "mu": mu, "pi": mu * r, "A": A, **params}, frozen)
    checked, worst = 0, 0.0
    for _ in range(8 * n):
        if checked >= n:
            break
        mu, pi = rng.uniform(0.02, 1.0, size=2)
        A = rng.choice([-1.0, 1.0]) * rng.uniform(0.1, 3.0)
        r = pi / mu
        h = 1e-6 * max(r, 1.0)
        frozen: dict = {}
        try:
            f0 = ell(r, mu, A, frozen)        # fills the stop-gradient values first
            fp, fm = ell(r + h, mu, A, frozen), ell(r - h, mu, A, frozen)
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
        expected = float(w(r, mu, A)) * A
        fwd, bwd = (fp - f0) / h, (f0 - fm) / h
        if not all(map(math.isfinite, (fwd, bwd, expected))):
            continue
        if abs(fwd - bwd) > 1e-3 * max(1.0, abs(fwd)):     # a kink lies within h: skip
            continue
        checked += 1
        worst = max(worst, abs((fwd + bwd) / 2 - expected) / max(1.0, abs(expected)))
    # too few finite points (an objective that overflows doubles, say) confirms nothing
    status = "failed" if worst >= 1e-4 else "passed" if checked >= n // 2 else "unconfirmed"
    return {"points": checked, "max_rel_error": float(worst), "passed": status == "passed", "status": status}


# ------------------------------------------------------------------ output helpers
def to_json(res: dict) -> dict:
    """The JSON form: SymPy strings that sympify reads back over r, mu, A and params."""
    import sympy as sp
    s = lambda e: sp.sstr(e)
    return {
        "name": res["name"], "params": res["params"], "options": res["options"],
        "objective": res["objective"], "weight": s(res["weight"]),
        "cases": [{"advantage": c["advantage"], "direction": c["direction"], "weight": s(c["weight"])}
                  for c in res["cases"]],
        "boundary": {adv: {"r": [s(e) for e in b["r"]], "pi": [s(e) for e in b["pi"]], "kind": b["kind"],
                           "reachable": b["reachable"], "numeric": b["numeric"]}
                     for adv, b in res["boundary"].items()},
        "reachable": res["reachable"],
        "weight_range": [None if v is None else float(v) for v in res["weight_range"]],
        "bounded": res["bounded"], "smooth": res["smooth"], "geometry": res["geometry"],
        "on_policy": res["on_policy"], "arbiter": res["arbiter"],
        "warnings": res["warnings"], "self_check": res["self_check"], "notes": res["notes"],
    }
