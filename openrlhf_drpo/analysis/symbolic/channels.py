"""What the gradient depends on beyond the r-weight w, for the language's third version:
- the entropy's own channel, w_H = ∂ℓ/∂H, so that ∇ℓ = w·r·A·∇log π + w_H·∇H (the host attaches
  H to the policy's graph), derived by the IR's derivative rules with H as the variable;
- the reference terms (those that read π_ref), whose part of w·r·A is ∂ℓ_ref/∂log π, written in
  q = π_ref/π (the view's π_ref = ρ_ref·μ is q·π).
Each is checked against central finite differences of ℓ by the IR's own float rules at random
points (H, and q, sampled too): 'confirmed', 'disagrees', or 'unconfirmed' where too few points
give finite differences."""
from __future__ import annotations

from openrlhf_drpo.analysis.numeric.sampling import numpy_fn
from openrlhf_drpo.analysis.batch.view import reference_split, term_sum
from dsl.ir import ONE, Node, rebuild
from dsl.printing import render
from dsl.walks import derivative, numpy_plan, to_sympy

FD_POINTS = 64      # random points of each finite-difference check, as the self-check's
H_RANGE = (0.0, 5.0)        # nats: where the entropy channel is checked (an entropy is ≥ 0)
Q_RANGE = (0.05, 20.0)      # π_ref/π where the reference terms are checked (log-uniform)


def _swap(n: Node, swap: dict) -> Node:
    """n with each var or param (op, name) in `swap` replaced."""
    return rebuild(n, lambda m, args: swap.get((m.op, m.value)) if m.op in ("var", "param") else None)


def _reads(n: Node, param: str) -> bool:
    return any(m.op == "param" and m.value == param for m in n.walk())


def entropy_channel(ctx, h_name: str, view=None) -> dict | None:
    """w_H = ∂ℓ/∂H on the view (`view`, ctx.obj by default, where H is the parameter h_name),
    written in the parameters' names (c, not 0.01) with H a symbol, with its finite-difference
    check at the parameters' values; None where the objective does not read H. A SymPy failure
    leaves w_H underived (status 'not derived'), said so."""
    view, sp = view or ctx.obj, ctx.sp
    if not _reads(view.expr, h_name):
        return None
    as_var = _swap(view.expr, {("param", h_name): Node("var", value=h_name)})
    dh = _swap(derivative(as_var, {h_name: ONE}), {("var", h_name): Node("param", value=h_name)})
    H = sp.Symbol(h_name, nonnegative=True)
    w_h = ctx.limited("the entropy channel", lambda: ctx.tidy(to_sympy(dh, sp, {**_named(ctx, view), h_name: H})))
    if w_h is None:
        return {"w_H": None, "check": {"status": "not derived", "points": 0, "max_rel_error": 0.0, "method": ""}}
    # clip's nested cases flattened: one 'x if c' per value, each condition whole
    w_h = sp.piecewise_fold(w_h.subs(sp.Abs(ctx.A), ctx.A * sp.sign(ctx.A)))
    fn = numpy_fn([ctx.r, ctx.mu, ctx.A, H], _valued(ctx, view, w_h, keep=(h_name,)))
    return {"w_H": w_h, "check": _entropy_check(view, h_name, fn)}


def _named(ctx, view) -> dict:
    """The SymPy environment with the view's parameters as symbols (β, δ, ρ_ref: a formula shows
    the names, not 1000·A·r for β = 1e-3), r, μ, π and A as the context's."""
    return {**ctx.env(False), **{k: ctx.param_syms.get(k) or ctx.sp.Symbol(k, real=True) for k in view.params}}


def _valued(ctx, view, e, keep=()):
    """e at the view's parameter values, but those in `keep` (what the finite differences check)."""
    sp = ctx.sp
    return e.subs({s: sp.Rational(v.numerator, v.denominator) for s in e.free_symbols
                   if s.name not in keep and (v := view.params.get(s.name)) is not None})


def reference_channel(ctx, ref_name: str, original, view=None) -> dict | None:
    """The terms of ℓ that read π_ref (analysis.batch.view.reference_split) and their part of ∇ℓ,
    ∂ℓ_ref/∂log π, in q = π_ref/π (and r, A where they read them too) and the parameters' names,
    with its finite-difference check; None where the objective does not read π_ref. `own`: the
    terms are a channel of their own, and w is the other terms' (no warning about w reads them).
    `view`: the analysed view (ctx.obj by default); `original`: the objective before it, whose
    terms the report prints."""
    view, sp = view or ctx.obj, ctx.sp
    if not _reads(view.expr, ref_name):
        return None
    rest, chosen = reference_split(view.expr, original.expr, ref_name)
    term = term_sum([v for v, _ in chosen])
    q = sp.Symbol("q", positive=True)

    def derive():
        d = to_sympy(derivative(term), sp, {**_named(ctx, view), ref_name: q * ctx.r})
        g = ctx.tidy(sp.expand(ctx.r * d, power_exp=False, log=False))
        # k3's β·(q − 1) reads better than −β + β·q; a piecewise form stays as tidied
        return g if g.has(sp.Piecewise) or g.count_ops() > 40 else sp.factor(g)
    g = ctx.limited("the reference terms", derive)
    text = _sum_text([o for _, o in chosen])
    if g is None:
        return {"terms": text, "own": rest is not None, "grad": None,
                "check": {"status": "not derived", "points": 0, "max_rel_error": 0.0, "method": ""}}
    g = g.subs(sp.Abs(ctx.A), ctx.A * sp.sign(ctx.A))
    fn = numpy_fn([ctx.r, ctx.mu, ctx.A, q], _valued(ctx, view, g))
    return {"terms": text, "own": rest is not None, "grad": g, "check": _reference_check(view, term, ref_name, fn)}


def _sum_text(terms) -> str:
    text = ""
    for s, t in terms:
        piece = render(t)
        text = (piece if s > 0 else f"-{piece}") if not text else f"{text} {'+' if s > 0 else '-'} {piece}"
    return text


def _points(seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    n = 8 * FD_POINTS
    mu, pi = rng.uniform(0.02, 1.0, size=(2, n))
    A = rng.choice([-1.0, 1.0], n) * rng.uniform(0.1, 3.0, n)
    return rng, mu, pi / mu, A


def _entropy_check(view, h_name, w_h) -> dict:
    """Central differences of ℓ in H (sg values held at the base point) against w_H."""
    rng, mu, r, A = _points()
    h0 = rng.uniform(*H_RANGE, r.shape)
    h = 1e-6 * (1.0 + h0)
    params = {k: float(v) for k, v in view.params.items()}
    run, frozen = numpy_plan(view.expr), {}

    def ell(x):
        return run({"r": r, "mu": mu, "pi": mu * r, "A": A, **params, h_name: x}, frozen)[0]
    return _compare(ell, h0, h, lambda: w_h(r, mu, A, h0), "central finite differences of ℓ in H by the IR's "
                    f"float rules, H ∈ [{H_RANGE[0]:g}, {H_RANGE[1]:g}] nats")


def _reference_check(view, term, ref_name, g) -> dict:
    """Central differences of the reference terms in r at fixed π_ref (ρ_ref = q·r at the base
    point), times r, against ∂ℓ_ref/∂log π."""
    import numpy as np
    rng, mu, r, A = _points(1)
    q = np.exp(rng.uniform(np.log(Q_RANGE[0]), np.log(Q_RANGE[1]), r.shape))
    h = 1e-6 * np.maximum(r, 1.0)
    params = {k: float(v) for k, v in view.params.items()} | {ref_name: q * r}
    run, frozen = numpy_plan(term), {}

    def ell(x):
        return run({"r": x, "mu": mu, "pi": mu * x, "A": A, **params}, frozen)[0]
    method = ("central finite differences of the terms in log π at fixed π_ref by the IR's float rules, "
              f"q = π_ref/π ∈ [{Q_RANGE[0]:g}, {Q_RANGE[1]:g}]")
    return _compare(lambda x: r * ell(x), r, h, lambda: g(r, mu, A, q), method)


def _compare(ell, x0, h, expected_fn, method) -> dict:
    """ell's central difference at x0 against expected_fn(), at up to FD_POINTS points where
    both one-sided differences agree (a kink within h is skipped) and every value is finite."""
    import numpy as np
    shape = np.shape(x0)
    f0 = np.broadcast_to(ell(x0), shape)        # fills the stop-gradient values first
    fp, fm = np.broadcast_to(ell(x0 + h), shape), np.broadcast_to(ell(x0 - h), shape)
    with np.errstate(all="ignore"):
        expected = np.broadcast_to(np.asarray(expected_fn(), dtype=float), shape)
        fwd, bwd = (fp - f0) / h, (f0 - fm) / h
        ok = np.isfinite(fwd) & np.isfinite(bwd) & np.isfinite(expected)
        ok &= np.abs(fwd - bwd) <= 1e-3 * np.maximum(1.0, np.abs(fwd))
        ok &= np.cumsum(ok) <= FD_POINTS
        err = np.abs((fwd + bwd) / 2 - expected) / np.maximum(1.0, np.abs(expected))
    checked = int(ok.sum())
    worst = float(err[ok].max()) if checked else 0.0
    status = "disagrees" if worst >= 1e-4 else "confirmed" if checked >= FD_POINTS // 2 else "unconfirmed"
    return {"status": status, "points": checked, "max_rel_error": worst, "method": method}
