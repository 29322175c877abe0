"""The symbolic derivation of an objective's weight, case by case.

With μ fixed, ∇r = r∇log π, so a per-token objective ℓ(r, μ, A) has gradient
(∂ℓ/∂r)·r·∇log π and induced weight w = (∂ℓ/∂r)/A relative to the surrogate r·A.
∂ℓ/∂r comes from the IR's own derivative rules (dsl.walks.derivative), the same ones the
torch compiler uses. Each case (sign of A × direction of the update) substitutes signed
positive symbols, A = ±a and r = 1 ± t, so SymPy can settle Piecewise conditions cheaply
instead of running its general inequality solvers, which can take seconds or recurse.
What this module derives are claims: analysis.symbolic.confirm checks each against the numeric arbiter.
"""
from __future__ import annotations

from openrlhf_drpo.analysis.symbolic.intervals import flipped, relations
from dsl.operations import OPS
from openrlhf_drpo.analysis.numeric.sampling import numpy_fn
from openrlhf_drpo.analysis.symbolic.settling import Settle
from dsl.walks import to_sympy
from openrlhf_drpo.analysis.symbolic.zeros import edges, zeros

SIGNS = (("positive", 1), ("negative", -1))
DIRECTIONS = ("diverging", "converging")


# ------------------------------------------------------------------ the weight
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
        found = [_candidate(ctx, sp.Integer(1), probe=None)]
        for direction in DIRECTIONS:
            s, tmax, pieces = case_weight(ctx, sign, direction)
            entangled |= any(ctx.a in (e.free_symbols | c.free_symbols) for e, c in pieces)
            back = {ctx.t: s * (ctx.r - 1), ctx.a: sign * ctx.A}
            shown = _as_piecewise(sp, [(ctx.tidy(e.subs(back)), _shown_condition(ctx, c, s, back)) for e, c in pieces])
            cases.append({"advantage": adv, "direction": direction, "weight": shown,
                          "_pieces": pieces, "_s": s, "_tmax": tmax})
            a_back = {ctx.a: sign * ctx.A}
            for zero in zeros(ctx, pieces, tmax):
                if zero[0] == "implicit":
                    # unevaluated: SymPy's Eq would ask its assumptions whether h is 0 (seconds at degree 9)
                    found.append(_candidate(ctx, sp.Eq(zero[1].subs(ctx.t, s * (ctx.r - 1)).subs(a_back), 0,
                                                       evaluate=False)))
                elif isinstance(zero[0], sp.Expr) and zero[0].is_real is not False and zero[0] != 0:
                    # (a Symbol is a Boolean to SymPy too; r = 1 itself is the seam's candidate)
                    found.append(_candidate(ctx, ctx.tidy(1 + s * zero[0]).subs(a_back)))
            found += [_candidate(ctx, (1 + s * e).subs(a_back), probe="edge") for e in edges(ctx, pieces)]
        candidates[adv] = [c for c in found if c is not None]
    return cases, candidates, entangled


def _candidate(ctx, r_star, probe="zero"):
    """A place the symbolic path says w may change sign, as (r*, π*(), g, explicit, edge):
    g(r, μ, A) is 0 there, and explicit(μ, A) gives r* for a closed-form zero of w, which the
    arbiter also probes outside the domain, or for a piece's edge (edge True), only a place w
    might jump, probed where the grid does not reach (r < 1e-15); r = 1 (probe None) is not."""
    sp = ctx.sp
    if isinstance(r_star, sp.logic.boolalg.BooleanAtom):    # an implicit edge that is constant: no place
        return None
    if isinstance(r_star, sp.Eq):
        h = r_star.lhs - r_star.rhs
        try:
            g = numpy_fn([ctx.r, ctx.mu, ctx.A], h)
        except Exception:       # noqa: BLE001 - an implicit edge numpy cannot build: left to the arbiter
            return None
        return r_star, (lambda: sp.Eq(h.subs(ctx.r, ctx.pi / ctx.mu), 0)), g, None, False
    explicit = numpy_fn([ctx.mu, ctx.A], r_star)
    # π* is built only for a candidate the arbiter keeps: tidying each one costs SymPy time
    return r_star, (lambda: ctx.tidy(ctx.mu * r_star)), (lambda r, mu, A: r - explicit(mu, A)), \
        explicit if probe else None, probe == "edge"


# ------------------------------------------------------------------ cases
def _case_subs(ctx, sign, direction):
    """A = sign·a, r = 1 + s·t with s = +sign when diverging (A·(r-1) > 0), else -sign."""
    s = sign if direction == "diverging" else -sign
    return s, {"r": 1 + s * ctx.t, "pi": ctx.mu * (1 + s * ctx.t), "A": sign * ctx.a}


def case_weight(ctx, sign, direction):
    """The weight on one case as [(expr, condition)] over t: conditions are mutually
    exclusive, equal expressions merged, and the last condition stands for 'otherwise'."""
    sp = ctx.sp
    s, subs = _case_subs(ctx, sign, direction)
    tmax = 1 if s < 0 else None
    # one memo for the two cases with the same r = 1 ± t (A > 0 diverging, A < 0 converging): one
    # domain, so a condition without A settles alike in both (a fifth of bandpo_chi2's time)
    settle = Settle(ctx, tmax, ctx.settled.setdefault(s, {}))
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
    swap = {rel: (rel.func if s > 0 else flipped(sp, rel.func))(ctx.r, ctx.tidy(1 + s * rel.rhs), evaluate=False)
            for rel in relations(sp, cond) if rel.lhs == t and t not in rel.rhs.free_symbols}
    return cond.xreplace(swap)


def _shown_condition(ctx, cond, s, back):
    """The condition in r, each side tidied as the weight is: the case's 1 + t² written back as
    2·r + (r − 1)² reads 1 − 1e-16 in doubles at r = 1e-12 (1 + r² is 1), and A² ≥ A²/that,
    true for every r, turned false there: w read 0 where it is −2·A·r."""
    cond = _in_r(ctx, cond, s).subs(back)
    return cond.xreplace({rel: rel.func(ctx.tidy(rel.lhs), ctx.tidy(rel.rhs))
                          for rel in relations(ctx.sp, cond)})


def _as_piecewise(sp, pieces):
    if len(pieces) == 1:
        return pieces[0][0]
    return sp.Piecewise(*pieces[:-1], (pieces[-1][0], True))


# ------------------------------------------------------------------ geometry
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
