"""An objective's weight w = (∂ℓ/∂r)/A by sympy.diff of its value, never by the IR's own
derivative rules (which the analysis, the arbiter and the fused kernel all share): the oracle
the tests hold those to. sg(x) and sign(x) pass no gradient: each is held as a symbol while
SymPy differentiates, then given back its value. Also the numeric helpers a check on random
points needs: where w bends too sharply to compare, and what a sign change of w is."""
import functools
import math
import re

import mpmath
import numpy as np
import scipy.special
import sympy as sp
from sympy.printing.numpy import NumPyPrinter

from dsl.ir import postorder
from dsl.walks import to_sympy

R, MU, A = sp.Symbol("r", positive=True), sp.Symbol("mu", positive=True), sp.Symbol("A", real=True, nonzero=True)
HELD = ("sg", "sign")


def _settled(e):
    """A comparison of constants decided at once, as the IR's floats decide it (one with NaN
    is false, but !=): SymPy cannot rewrite an undecided one on numbers inside a Piecewise."""
    if not isinstance(e, sp.core.relational.Relational) or e.free_symbols:
        return e
    try:
        return sp.true if bool(e.func(*e.args)) else sp.false
    except TypeError:       # NaN or zoo
        return sp.true if isinstance(e, sp.Ne) else sp.false


def sympy_weight(obj):
    """w(r, μ, A) of a token-level objective (an analysis view for a sequence one), in SymPy,
    its parameters at their values."""
    env = {"r": R, "mu": MU, "A": A, "pi": MU * R,
           **{k: sp.Rational(v.numerator, v.denominator) for k, v in obj.params.items()}}
    held = {m: sp.Symbol(f"held{i}", real=True) for i, m in enumerate(m for m in postorder(obj.expr) if m.op in HELD)}
    memo = dict(held)
    w = sp.diff(to_sympy(obj.expr, sp, env, _settled, memo), R) / A
    # outermost first: a held value may itself hold an inner one
    for m, symbol in reversed(held.items()):
        inner = to_sympy(m.args[0], sp, env, _settled, {k: v for k, v in memo.items() if k is not m})
        w = w.subs(symbol, sp.sign(inner) if m.op == "sign" else inner)
    return w


class _Printer(NumPyPrinter):
    """numpy text that broadcasts a constant argument: Min and Max pairwise (numpy's amin
    stacks its arguments into one array), Piecewise as nested where (select wants arrays),
    Heaviside as numpy's (SymPy's printer rewrites it as a Piecewise first, which can take
    it seconds of simplification)."""
    def _print_Min(self, e):
        return functools.reduce(lambda a, b: f"numpy.minimum({a}, {b})", map(self._print, e.args))

    def _print_Max(self, e):
        return functools.reduce(lambda a, b: f"numpy.maximum({a}, {b})", map(self._print, e.args))

    def _print_Heaviside(self, e):      # SymPy's H(0) = 1/2 (any value will do: ties are not compared)
        return f"numpy.heaviside({self._print(e.args[0])}, 0.5)"

    def _print_Piecewise(self, e):
        out = "numpy.nan"
        for value, cond in reversed(e.args):
            out = f"numpy.where({self._print(cond)}, {self._print(value)}, {out})"
        return out


def weight_function(obj):
    """sympy_weight as a vectorized numpy function of (r, μ, A). Where a Heaviside's argument
    reads exactly 0 in doubles, w there is taken again in 50 digits (at the same doubles): the
    step of min(A²/(1 + r²), A²) at r = 1e-10 is 1, but 1 + r² rounds to 1 and the tie would
    read H(0) = 1/2, half the true weight, over every r below ~1e-8."""
    w = sympy_weight(obj)
    f = sp.lambdify([R, MU, A], w, [{"erf": scipy.special.erf}, "numpy"],
                    printer=_Printer({"fully_qualified_modules": False, "inline": True}))
    steps = [sp.lambdify([R, MU, A], h.args[0], [{"erf": scipy.special.erf}, "numpy"],
                         printer=_Printer({"fully_qualified_modules": False, "inline": True}))
             for h in w.atoms(sp.Heaviside)]
    exact = functools.cache(lambda: sp.lambdify([R, MU, A], w, [{"Heaviside": _heaviside}, "mpmath"]))

    def weight(r, mu, a):
        r, mu, a = np.broadcast_arrays(r, mu, a)
        with np.errstate(all="ignore"):
            out = np.array(np.broadcast_to(np.asarray(f(r, mu, a), dtype=float), r.shape))
            ties = functools.reduce(np.logical_or, (np.broadcast_to(g(r, mu, a), r.shape) == 0 for g in steps),
                                    np.zeros(r.shape, dtype=bool))
        with mpmath.workdps(50):
            for i in zip(*np.nonzero(ties)):
                x = mpmath.mpmathify(exact()(*(mpmath.mpf(float(v[i])) for v in (r, mu, a))))
                out[i] = float(x.real) if x.imag == 0 else np.nan     # (a root of a negative, as numpy reads it)
        return out
    return weight


def _heaviside(x, at_zero=0.5):     # SymPy's H(0) = 1/2: a true tie is not compared (see bends)
    return at_zero if x == 0 else float(x > 0)


STEP = 1e-7         # relative step of the three-point bend test


def bends(f, rs, mu, a):
    """Where w(r) is not smooth around r: a jump or a kink within r·(1 ± 2·STEP), seen as three
    consecutive values of five lying off a straight line by more than half their spread (or not
    finite); five, since a jump at r itself, w(r) halfway, leaves the middle three in line. A
    steep smooth w passes: its values there lie on a line to ~STEP times its curvature."""
    ys = [f(rs * (1 + k * STEP), mu, a) for k in (-2, -1, 0, 1, 2)]
    out = np.zeros(np.shape(rs), dtype=bool)
    with np.errstate(all="ignore"):
        for lo, mid, hi in zip(ys, ys[1:], ys[2:]):
            bend = np.abs(hi - 2 * mid + lo)
            spread = np.abs(hi - mid) + np.abs(mid - lo)
            out |= ~np.isfinite(bend + spread) | (bend > 0.5 * spread + 1e-12 * np.maximum(1, np.abs(mid)))
    return out


def sign_change(f, r0, r1, mu, a):
    """A sign change of w between r0 and r1, narrowed by bisection to where doubles end: ("undefined",
    r) where w is not finite in between, ("pole", r) where |w| grows without bound at it,
    ("zero", r) where it crosses or jumps across 0."""
    def w(x):
        return float(f(np.array([x]), mu, a)[0])
    w0, w1 = w(r0), w(r1)
    for _ in range(2100):       # enough halvings for any bracket of doubles
        m = math.sqrt(r0 * r1) if r1 > 2 * r0 else (r0 + r1) / 2
        if not r0 < m < r1:
            break
        wm = w(m)
        if not math.isfinite(wm):
            return "undefined", m
        if wm == 0:
            return "zero", m
        if (wm > 0) == (w0 > 0):
            r0, w0 = m, wm
        else:
            r1, w1 = m, wm
    # at a pole |w| grows toward it: far above its values a little way off; at a crossing or
    # a jump it is not
    r = (r0 + r1) / 2
    off = max(abs(w(r * (1 - 1e-6))), abs(w(r * (1 + 1e-6))))
    return ("pole" if min(abs(w0), abs(w1)) > 1e3 * off else "zero"), r


def located(where: str, r: float, mu: float, A: float | None = None) -> bool:
    """Whether the point (r, μ) lies at a place a report describes (events.describe's four forms:
    a fixed r, a fixed π, a fixed π − μ, or a span of r), to the 6 digits it prints them with;
    one found at some |A| only (`... at |A| from 10 to 1000 of those sampled (it depends on |A|)`) there."""
    def near(x, want, scale):
        return abs(x - want) <= 1e-5 * scale
    number = r"(-?[0-9.]+(?:e[+-]?\d+)?)"
    # at the |A| sampled, quarter decades apart: where the run ends between two of them is not known
    if m := re.fullmatch(r"(.*) at \|A\| (= [^a-z]+(?: only)?|from \S+ to \S+) of those sampled \(it depends on \|A\|\)",
                         where):
        values = [float(x) for x in re.findall(number, m[2])]
        bands = [(values[0], values[1])] if m[2].startswith("from") else [(v, v) for v in values]
        return (A is None or any(lo / 10 ** 0.25 <= abs(A) <= hi * 10 ** 0.25 for lo, hi in bands)) \
            and located(m[1], r, mu)
    if m := re.fullmatch(rf"r ≈ {number} \(π ≈ .*\)", where):
        return near(r, float(m[1]), max(1.0, r))
    if m := re.fullmatch(rf"π ≈ {number}", where):
        return near(r * mu, float(m[1]), max(1e-12, r * mu))
    if m := re.fullmatch(rf"π ≈ μ ([+−]) {number}", where):
        shift = float(m[2]) if m[1] == "+" else -float(m[2])
        return near(r * mu - mu, shift, max(abs(shift), mu))
    if m := re.fullmatch(rf"r from {number} to {number} as μ and \|A\| vary .*", where):
        return float(m[1]) * (1 - 1e-5) <= r <= float(m[2]) * (1 + 1e-5)
    raise ValueError(f"not a place a report describes: {where!r}")
