"""The extremes of w = (∂ℓ/∂r)/A, by the IR's float rules: its range over the arbiter's
grid, each extreme refined between grid points by a pattern search and a side reported
unbounded where w keeps growing toward a pole, an undefined edge or the domain's corners;
and the on-policy weight at r = 1 (not on the grid), its interval and status per sign of A
(the warnings that status raises are analysis.alerts')."""
from __future__ import annotations

import math

from openrlhf_drpo.analysis.numeric.arbiter import (CORNER_MUS, CORNER_RS, DENSE_MAGNITUDES, MAGNITUDES, MUS, SIDE_SIGNS, SIGNS,
                      params_key, thresholds)
from dsl.walks import numpy_plan

HUGE = 1e100                # |w| this large before ℓ overflows is reported as unbounded
ON_POLICY_MAGNITUDES = 61   # |A| log-spaced over MAGNITUDES' span for the on-policy interval


def on_policy(obj, dl) -> dict:
    """w and ℓ at r = 1 (π = μ), per sign of A: what the first mini-batch of every PPO-style
    step sees, over μ and a dense |A| grid with the objective's own thresholds, its extremes
    refined in between. status: "ok" (w > 0), "zero" (no on-policy gradient), "negative" (the
    gradient opposes A), "undefined" (ℓ or w is 0/0, a pole, or not a finite double there)."""
    import numpy as np
    run = numpy_plan(obj.expr, dl)       # ∂ℓ/∂r at fixed μ and A, by the IR's rules
    params = {k: float(v) for k, v in obj.params.items()}
    found = thresholds(obj.expr, dl, params_key(params))
    # on policy π = μ: a threshold on π is one on μ there
    mus = np.unique(np.concatenate([MUS, np.logspace(-6, 0, 25), found["mu"], found["pi"]]))
    mus = mus[(mus > 0) & (mus <= 1)]
    mags = np.unique(np.concatenate([np.logspace(-3, 3, ON_POLICY_MAGNITUDES), found["A"]]))
    mu, mag = (x.ravel() for x in np.meshgrid(mus, mags))

    def at(r, mu, A):
        ell, dl_ = (np.broadcast_to(v, np.shape(mu)) for v in run({"r": r, "mu": mu, "pi": mu * r, "A": A, **params}))
        with np.errstate(all="ignore"):
            return ell, dl_ / A
    out, starts = {}, []
    for adv, sign in SIGNS:
        ell, w = at(np.ones_like(mu), mu, sign * mag)
        undefined = ("ℓ is not finite" if not np.isfinite(ell).all() else
                     "w is 0/0, a pole or not finite" if not np.isfinite(w).all() else None)
        ok = np.isfinite(w) & np.isfinite(ell)
        ws = w[ok]
        lo, hi = (float(ws.min()), float(ws.max())) if ws.size else (None, None)
        if ws.size and lo < hi:     # an extreme between sampled μ and |A| (a peak at an intermediate |A|)
            starts += [(adv, sign, s, k) for s in (1.0, -1.0) for k in np.argsort(np.where(ok, s * w, -np.inf))[-2:]]
        # continuous at r = 1 where defined: w there is the limit from both sides
        with np.errstate(all="ignore"):
            jumps = [np.abs(at(r, mu, sign * mag)[1] - w) > 1e-6 * np.maximum(1.0, np.abs(w))
                     for r in (1 - 1e-12, 1 + 1e-12)]
        out[adv] = {"w": [lo, hi], "why": undefined, "jumps": bool(np.any(np.isfinite(w) & (jumps[0] | jumps[1])))}
    if starts:      # every search at once: one evaluation per step for all of them
        sign, s = (np.array([x[i] for x in starts])[:, None] for i in (1, 2))
        k = np.array([x[3] for x in starts])
        lo_b, hi_b = (np.array(b)[:, None, None] for b in ([math.log(mus[0]), math.log(mags[0])],
                                                             [0.0, math.log(mags[-1])]))

        def f(y):
            e, v = at(np.ones(y.shape[1:]), np.exp(y[0]), sign * np.exp(y[1]))
            return np.where(np.isfinite(e) & np.isfinite(v), s * v, -np.inf)
        best = _climb(f, np.stack([np.log(mu[k]), np.log(mag[k])]), lambda y: np.clip(y, lo_b, hi_b), steps=40)
        for (adv, _, sg, _), b in zip(starts, best):
            lo, hi = out[adv]["w"]
            out[adv]["w"] = [lo, max(hi, b)] if sg > 0 else [min(lo, -b), hi]
    for f_ in out.values():
        lo, hi = f_["w"]
        f_["status"] = ("undefined" if f_["why"] else "zero" if hi == lo == 0 else
                        "negative" if lo < 0 else "zero" if lo == 0 else "ok")
    return {adv: {k: f_[k] for k in ("w", "status", "why", "jumps")} for adv, f_ in out.items()}


def _climb(f, x, project, steps=60):
    """max of f by a pattern search from each column of x (all directions, diagonals too: an
    extreme can sit on a ridge such as r = |A|), each point kept inside the domain by project.
    Returns the best value found from each."""
    import numpy as np
    dims, n = x.shape
    dirs = np.array(np.meshgrid(*[[-1.0, 0.0, 1.0]] * dims)).reshape(dims, -1)
    dirs = dirs[:, np.any(dirs != 0, axis=0)]
    best = f(x[:, :, None])[:, 0]
    step = np.full(n, 0.05)
    with np.errstate(all="ignore"):
        for _ in range(steps):
            y = project(x[:, :, None] + step[None, :, None] * dirs[:, None, :])      # (dims, points, directions)
            v = f(y)
            k = np.argmax(v, axis=1)
            gain = v[np.arange(n), k]
            better = gain > best
            x[:, better] = y[:, better, k[better]]
            best = np.where(better, gain, best)
            step = np.where(better, step, step / 2)
            if step.max() < 1e-12:      # converged everywhere: the rest would change nothing
                break
    return best


def w_range(arb, facts):
    """[lo, hi] of w over the grid; None for a side that is unbounded: w grows toward a
    pole, an edge of the undefined region, or the domain's corners (μ → 0, r → 0 or ∞)."""
    np = arb.np
    if not arb.valid.any():
        return None
    lo, hi = -_refined_extreme(arb, -1.0), _refined_extreme(arb, 1.0)
    # beyond the grid's corners (μ down to 1e-12, r down to 1e-15): does w keep growing?
    mus = np.logspace(-16, -13, 4)[:, None]
    pis = np.logspace(-16, 0, 240)[None, :]
    small_r = np.logspace(-20, -16, 5)[None, :]
    ext = []
    mags = sorted(set(MAGNITUDES) | set(arb.magnitudes) | set(DENSE_MAGNITUDES * (len(arb.magnitudes) > 1)))
    A = np.repeat(np.outer(SIDE_SIGNS, mags).ravel(), mus.size)[:, None]
    mu = np.tile(mus, (2 * len(mags), 1))
    r = np.broadcast_to(pis / mu, (mu.size, pis.size))
    # and both sides of each threshold along these rows (one search for all): a band 2e-4 wide
    # in π − μ falls between the 240 values of π, while w in it grows as 1/μ
    r = np.concatenate([r, arb.row_thresholds(r, mu[:, 0], A[:, 0], arb.row_quantities)], axis=1)
    ext.append(arb.w(np.where(r == 1, np.nan, r), mu, A).ravel())
    for a in A[::mus.size, 0]:
        ext.append(arb.w(small_r, np.unique(arb.mu)[:, None], a).ravel())
    ext = np.concatenate(ext)
    ext = ext[np.isfinite(ext)]
    unbounded_lo = ext.size and ext.min() < lo - 1e-3 * max(1.0, abs(lo))
    unbounded_hi = ext.size and ext.max() > hi + 1e-3 * max(1.0, abs(hi))
    # |A| → 0 or ∞, for weights that depend on it: a side grows without bound only where w keeps
    # growing from |A| = 1e-9 on to 1e-12 (1e9 to 1e12); w that settles there (3.5e6/(3.7e6·|A| + 7)
    # → 5e5) is bounded, and the range takes in its value at 1e-12 (1e12)
    first = arb.mag[:, 0] == arb.magnitudes[0]
    R, M = arb.R[first], arb.mu[first]
    grows, settles = [], []
    for sign in SIDE_SIGNS:
        for steps in ((1e-9, 10 ** -10.5, 1e-12), (1e9, 10 ** 10.5, 1e12)):
            w0, w1, w2 = (arb.w(R, M, sign * a) for a in steps)
            with np.errstate(all="ignore"):
                keeps = (np.abs(w2 - w1) > 0.5 * np.abs(w1 - w0)) & (np.sign(w2 - w1) == np.sign(w1 - w0))
            grows.append(np.where(keeps, w2, np.nan).ravel())
            settles.append(np.where(keeps, np.nan, w2).ravel())
    grows, settles = (x[np.isfinite(x)] for x in (np.concatenate(grows), np.concatenate(settles)))
    by_magnitude = (bool(grows.size and grows.min() < lo - 1e-3 * max(1.0, abs(lo))),
                    bool(grows.size and grows.max() > hi + 1e-3 * max(1.0, abs(hi))))
    if settles.size and len(arb.magnitudes) > 1:   # (where w does not read |A|, the grid's values again)
        lo, hi = min(lo, float(settles.min())), max(hi, float(settles.max()))
    for adv in ("positive", "negative"):
        near = facts[adv]["poles"] + [u for u in facts[adv]["undefined"] if u["w_grows"]]
        for p in near:
            if p.get("towards"):        # slow divergence (log): the side it diverges to, measured
                unbounded_hi |= p["towards"] > 0
                unbounded_lo |= p["towards"] < 0
                continue
            h = 1e-9 * max(1.0, p["r"])
            for r in (p["r"] - h, p["r"] + h):
                v = float(arb.w(r, p["mu"], p["A"]))
                unbounded_hi |= math.isfinite(v) and v > 0
                unbounded_lo |= math.isfinite(v) and v < 0
    if any(facts[adv]["touches"] for adv in ("positive", "negative")):
        lo, hi = min(lo, 0.0), max(hi, 0.0)     # w = 0 exactly there, between grid points
        # an extreme within rounding of 0 beside a touch is the touch's 0 (cancellation
        # leaves −4e-16 where (1.5 − r)² is expanded), not a sign change
        tiny = 1e-12 * float(np.median(arb.row_scale))
        lo, hi = (0.0 if abs(x) <= tiny else x for x in (lo, hi))
    unbounded_lo |= lo < -HUGE
    unbounded_hi |= hi > HUGE
    # unbounded by small or large |A| alone, nowhere by r or μ: the warning names the advantage
    facts["unbounded_by_magnitude"] = any(by_magnitude) and not (unbounded_lo or unbounded_hi)
    unbounded_lo, unbounded_hi = unbounded_lo or by_magnitude[0], unbounded_hi or by_magnitude[1]
    return [None if unbounded_lo else lo, None if unbounded_hi else hi]


def _refined_extreme(arb, s, keep=8):
    """max of s·w: the grid's best points, each improved by a pattern search over log μ,
    log r and log |A| inside the domain, since it can lie between grid points and sampled |A|."""
    np = arb.np
    vals = np.where(arb.valid, s * arb.W, -np.inf)
    # each seed a row's best point: the grid's best eight were one jump's side at μ = 1 on three rows
    # of |A|, and w → −8.34 toward the corner π = 1, μ → 1 for the other sign of A was never climbed
    cols = np.argmax(vals, axis=1)
    rows = np.argsort(vals[np.arange(cols.size), cols])[-keep:]
    cols = cols[rows]
    free = len(arb.magnitudes) > 1          # |A| only where w depends on it
    mus, rs, signs, mags = arb.mu[rows, 0], arb.R[rows, cols], arb.sign[rows, 0], arb.mag[rows, 0]
    if free:
        # w may peak or dip between the rows' |A| with no threshold to say where (e^(−(|A| − 10)²)):
        # the best points of a coarse scan over DENSE_MAGNITUDES seed the search too
        m, r, a, g = (c.ravel() for c in np.meshgrid(np.unique(arb.mu[:, 0])[::4], np.geomspace(1e-15, 1e12, 55),
                                                      DENSE_MAGNITUDES, SIDE_SIGNS, indexing="ij"))
        v = np.where(m * r <= 1, s * arb.w(r, m, g * a), np.nan)
        best = np.argsort(np.where(np.isfinite(v), v, -np.inf))[-keep:]
        mus, rs, signs, mags = (np.concatenate([x, y[best]]) for x, y in ((mus, m), (rs, r), (signs, g), (mags, a)))
    x = np.stack([np.log(mus), np.log(rs)] + [np.log(mags)] * free)
    sign, mag = signs[:, None], mags[:, None]
    span = [math.log(min(MAGNITUDES[0], arb.magnitudes[0])), math.log(max(MAGNITUDES[-1], arb.magnitudes[-1]))]

    def f(y):
        v = s * arb.w(np.exp(y[1]), np.exp(y[0]), sign * (np.exp(y[2]) if free else mag))
        return np.where(np.isfinite(v), v, -np.inf)

    def project(y):
        # inside the grid's domain (μ ≤ 1, π = μ·r ≤ 1, and its corners): what lies beyond
        # is w_range's test of whether w keeps growing there
        y[0] = np.clip(y[0], math.log(CORNER_MUS[-1]), 0.0)
        y[1] = np.clip(y[1], math.log(CORNER_RS[0]), -y[0])
        if free:
            y[2] = np.clip(y[2], *span)
        return y
    return max(float(np.max(_climb(f, x, project))), float(np.max(vals[rows, cols])))
