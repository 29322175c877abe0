"""The numeric arbiter: facts about an objective found with the IR's own float rules (the
rules the compiled loss follows), never with SymPy, so that they check the symbolic
derivation independently: the on-policy weight, and on a dense (μ, π) grid for both signs
of A and several |A|, the weight itself, where it changes sign, jumps or has a pole, where
ℓ or w is undefined, and its range."""
from __future__ import annotations

import functools
import itertools
import math
import warnings

from .ir import Node, numpy_plan, postorder

# μ across six decades and |A| across six: a value that holds on all of them is reported as a
# number, one that does not as the interval it spans
MUS = (1e-6, 1e-3, 0.1, 0.5, 1.0)
MAGNITUDES = (1e-3, 1.0, 1e3)
# where w depends on |A| smoothly (no threshold says where it changes): quarter decades over MAGNITUDES'
# span, for the candidates' probes and the range's search
DENSE_MAGNITUDES = tuple(10 ** (k / 4) for k in range(-12, 13))
SIGNS = (("positive", 1.0), ("negative", -1.0))
# the domain's corners beyond the regular grid: μ → 0 with r up to 1/μ (a clamp at |log r| = 12
# is met only there), and r → 0
CORNER_MUS = (2.7e-10, 1.3e-12)     # not round: a threshold on π at a round value stays off r = 1
CORNER_RS = (1e-15, 1e-12, 1e-9, 1e4, 1e5, 3e5, 1e6, 1e7, 3e7, 1e8, 1e9, 1e10, 1e11, 1e12)
ON_POLICY_MAGNITUDES = 61   # |A| log-spaced over MAGNITUDES' span for the on-policy interval


def on_policy(obj, dl) -> dict:
    """w and ℓ at r = 1 (π = μ), per sign of A: what the first mini-batch of every PPO-style
    step sees, over μ and a dense |A| grid with the objective's own thresholds, its extremes
    refined in between. status: "ok" (w > 0), "zero" (no on-policy gradient), "negative" (the
    gradient opposes A), "undefined" (ℓ or w is 0/0, a pole, or not a finite double there)."""
    import numpy as np
    run = numpy_plan(obj.expr, dl)       # ∂ℓ/∂r at fixed μ and A, by the IR's rules
    params = {k: float(v) for k, v in obj.params.items()}
    found = thresholds(obj.expr, dl, _key(params))
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


# ------------------------------------------------------------------ structure
# Where the objective itself says things change: every quantity it compares (a condition, a
# clip, a min or max). One that reads only |A|, only μ, only r or only π has thresholds found
# once along that variable; one that reads r or π with μ or A (π − μ ≤ 0.1) has them per row.
THRESHOLD_SAMPLES = 2001    # points of each one-variable search for a threshold
ROW_QUANTITIES = 8          # compared quantities in r searched per row; past it, the grid alone
ROW_THRESHOLDS = 4          # thresholds in r added per row (a point either side of each)
BAND_THRESHOLDS = 6         # thresholds on |A| or μ given rows of their own (either side, and inside)
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


def _key(params):
    return tuple(sorted(params.items()))


def _compared(*roots):
    """(a − b, the variables it reads) for every pair the objective compares: each comparison,
    each pair of a min or max, a clip's argument against either bound."""
    reads, out, seen = {}, [], set()
    for m in postorder(Node("tuple", roots)):
        reads[m] = frozenset([m.value]) if m.op == "var" else frozenset().union(*(reads[a] for a in m.args))
        pairs = ([m.args] if m.op in _COMPARE else itertools.combinations(m.args, 2) if m.op in ("min", "max")
                 else [m.args[:2], m.args[::2]] if m.op == "clip" else [])
        for a, b in pairs:
            if reads[a] | reads[b] and (a, b) not in seen:
                seen.add((a, b))
                out.append((Node("sub", (a, b)), reads[a] | reads[b]))
    return out


def _state(v):
    import numpy as np
    return np.where(np.isfinite(v), np.sign(v), 2.0)


def _crossings(run, k, xs, env):
    """(quantity, row, x) arrays: where each of run's k quantities changes sign (or
    definedness) along each row of xs (ascending, nan past the row's end), each bracket halved
    BISECTIONS times; env(x, row) is the environment at x on that row."""
    import numpy as np
    xs = np.atleast_2d(xs)

    def states(x, row):
        return _state(np.stack([np.broadcast_to(q, x.shape) for q in run(env(x, row))]))
    s = states(xs, np.arange(xs.shape[0])[:, None])
    both = ~np.isnan(xs[:, 1:]) & ~np.isnan(xs[:, :-1])
    i, row, j = np.nonzero((s[:, :, 1:] != s[:, :, :-1]) & both)
    lo, hi, sl = xs[row, j], xs[row, j + 1], s[i, row, j]
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        low = states(mid, row)[i, np.arange(i.size)] != sl
        lo, hi = np.where(low, lo, mid), np.where(low, mid, hi)
    return i, row, (lo + hi) / 2


SIDE = 1e-6     # a threshold's two sides, relative to it: clear of a derived formula's rounding


def _sides(x, ratio=False):
    """The points either side of thresholds x; for a ratio, never across r = 1 (r = 1 ± μ at μ = 1e-12)."""
    import numpy as np
    x = np.asarray(x, dtype=float)
    d = SIDE * np.abs(x)
    if ratio:
        d = np.where(x != 1, np.minimum(d, np.abs(x - 1) / 2), d)
    return x - d, x + d


@functools.lru_cache(maxsize=64)
def thresholds(expr, dl, params) -> dict:
    """The objective's thresholds, each as the two doubles either side of it: "A" (|A|), "mu",
    "r", "pi" found once along that variable, with a point inside each band of |A| and μ; and
    "rows", the quantities that read r or π with μ or A (searched per row by the Arbiter)."""
    import numpy as np
    params = dict(params)
    groups = {}
    for q, reads in _compared(expr, dl):
        name = (next(iter(reads)) if len(reads) == 1 else "muA" if reads == {"mu", "A"} else "rows")
        groups.setdefault(name, []).append(q)
    n = THRESHOLD_SAMPLES
    unit = np.unique(np.concatenate([np.logspace(-15, 0, n), np.linspace(0, 1, n)[1:]]))
    axes = {"A": np.logspace(-6, 6, n), "mu": unit, "pi": unit,
            "r": np.unique(np.concatenate([np.logspace(-15, 15, n), np.linspace(0, 3, n)[1:]]))}

    def search(qs, var, fixed=None):
        run = numpy_plan(*qs)
        signs = (1.0, -1.0) if var == "A" else (1.0,)
        out = []
        for sg in signs:
            def env(x, row):
                e = {"r": 1.0, "mu": 1.0, "pi": 1.0, "A": 1.0, **params, **(fixed or {})}
                e[var] = sg * x
                return e
            out += np.concatenate(_sides(_crossings(run, len(qs), axes[var], env)[2], var == "r")).tolist()
        return out

    found = {v: search(groups[v], v) if v in groups else [] for v in ("A", "mu", "r", "pi")}
    for v in ("A", "mu"):
        found[v] = _bands(found[v])
    for v in ("r", "pi"):       # the ROW_THRESHOLDS nearest r = 1 (π = 1): each adds a column to every row
        found[v] = sorted(sorted(set(found[v]), key=lambda x: abs(math.log(x)) if x > 0 else math.inf)[:2 * ROW_THRESHOLDS])
    if "muA" in groups:     # |A| ≤ 1/μ: thresholds in μ at each |A| sampled
        for mag in sorted(set(MAGNITUDES) | set(found["A"])):
            found["mu"] += [x for s in (1.0, -1.0) for x in search(groups["muA"], "mu", {"A": s * mag})]
        found["mu"] = _bands(found["mu"])
    return {**{v: np.array(sorted(set(x)), dtype=float) for v, x in found.items()},
            "rows": tuple(groups.get("rows", ())[:ROW_QUANTITIES])}


def _bands(xs):
    """The first BAND_THRESHOLDS thresholds' sides (xs holds them in pairs), with the geometric
    middle of each band between two of them."""
    xs = sorted(set(xs))[:2 * BAND_THRESHOLDS]
    return xs + [math.sqrt(a * b) for a, b in zip(xs[1:-1:2], xs[2::2])]


def on_policy_warnings(facts: dict) -> list[str]:
    out = []
    for adv, sign_text in (("positive", "A > 0"), ("negative", "A < 0")):
        f = facts[adv]
        if f["status"] == "undefined":
            out.append(f"on policy (r = 1, the first mini-batch of every step) for {sign_text}: {f['why']} "
                       "there, so the compiled loss is NaN or inf on it")
        elif f["status"] == "zero":
            out.append(f"on policy (r = 1) for {sign_text}, w = 0 at some μ or |A|: those tokens get no gradient "
                       "until the policy has moved")
        elif f["status"] == "negative":
            out.append(f"on policy (r = 1) for {sign_text}, w < 0 at some μ or |A|: the gradient pushes against "
                       "the advantage from the first update")
    return out


# ------------------------------------------------------------------ the grid
GRID_NODE_POINTS = 3e7      # grid points × IR nodes per evaluation: bounds the arbiter's time
UNDERFLOW = 1e-200          # |w| this small beside an exact 0: a double's underflow (e^-745), not a mask
HUGE = 1e100                # |w| this large before ℓ overflows is reported as unbounded
BISECTIONS = 60             # halvings of a bracket: from 1e-3 wide to below a double's resolution
SIDE_SIGNS = (1.0, -1.0)
CLUSTER = 1e-4              # relative: changes of state this close may be rounding around one zero


def grid_axes(nodes: int, magnitudes: int):
    """The grid's μ values and its r values (before π ≤ 1 cuts them per μ): about 30 μ from
    1e-6 to 1 and 1,200 r from 1e-6 to 1e6, fewer as the expression grows, so that one
    evaluation costs at most GRID_NODE_POINTS node-points."""
    import numpy as np
    scale = min(1.0, math.sqrt(GRID_NODE_POINTS / (nodes * 2 * magnitudes * 30 * 1200)))
    n_mu, n_lin, n_log = max(6, int(30 * scale)), max(100, int(900 * scale)), max(40, int(300 * scale))
    mus = np.unique(np.concatenate([np.logspace(-6, 0, n_mu // 2), np.linspace(0.02, 1, n_mu - n_mu // 2)]))
    base = np.unique(np.concatenate([np.linspace(0, 3, n_lin + 1)[1:], np.logspace(-6, 6, n_log)]))
    return mus, base


class Arbiter:
    """ℓ and w = (∂ℓ/∂r)/A over 0 < μ ≤ 1, 0 < π ≤ 1 (r = π/μ), one row per (sign of A,
    |A|, μ) with r ascending. Every event along a row (a sign change, a jump, a pole, an
    edge of the undefined region) is located by bisection on the IR's own rules."""

    def __init__(self, obj, dl):
        import numpy as np
        self.np, self.obj, self.dl = np, obj, dl
        self.params = {k: float(v) for k, v in obj.params.items()}
        found = thresholds(obj.expr, dl, _key(self.params))
        # beside the regular grid: both sides of every threshold the objective compares |A|, μ,
        # r or π with (and the inside of each band of |A| and μ), and the domain's corners
        candidates = tuple(np.unique(np.concatenate([MAGNITUDES, found["A"]])))
        mus, base = grid_axes(len(set(obj.expr.walk()) | set(dl.walk())), len(candidates))
        band_mus = found["mu"][(found["mu"] > 0) & (found["mu"] <= 1)]
        mus = np.unique(np.concatenate([mus, band_mus, CORNER_MUS]))
        base = np.unique(np.concatenate([base, CORNER_RS, found["r"][found["r"] > 0]]))
        base = base[base != 1.0]            # r = 1 itself is the on-policy check's
        # other |A| only where w depends on |A|: probed on every third μ (and each band's) first
        probe = np.unique(np.concatenate([mus[::3], band_mus]))
        mags = candidates if self._depends_on_magnitude(base[::2], probe, candidates) else (1.0,)
        rows = [(sg, mag, mu) for sg in SIDE_SIGNS for mag in mags for mu in mus]
        self.sign, self.mag, self.mu = (np.array(c)[:, None] for c in zip(*rows))
        self.magnitudes = mags
        cap = 1 / self.mu
        R = np.tile(base, (len(rows), 1))
        R[R > cap * (1 + 1e-12)] = np.nan                        # π > 1 is outside the domain
        # per row: thresholds on π (r = c/μ), and on quantities that read r with μ or A (π − μ)
        R = np.concatenate([R, found["pi"][None, :] / self.mu, self._row_thresholds(R, found["rows"]),
                            np.where(cap > 1, cap, np.nan)], axis=1)    # π = 1 exactly (r = 1 is not sampled)
        R[(R > cap * (1 + 1e-12)) | (R == 1.0)] = np.nan
        self.R = np.sort(R, axis=1)                              # nan last
        self.W = self.w(self.R, self.mu, self.sign * self.mag)
        self.valid = np.isfinite(self.W)
        self.inside = ~np.isnan(self.R)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # a row where w is nowhere nonzero
            a = np.where(self.valid, np.abs(self.W), np.nan)
            self.row_scale = np.nan_to_num(np.nanmedian(np.where(a > 0, a, np.nan), axis=1), nan=1.0)[:, None]

    def _row_thresholds(self, R, quantities):
        """Both sides of each place along a row where a compared quantity that reads r with μ
        or A (|π − μ| ≤ 0.1, A·(r − 1) ≤ 0) changes sign: the first ROW_THRESHOLDS per row."""
        np = self.np
        out = np.full((R.shape[0], 2 * ROW_THRESHOLDS), np.nan)
        if not quantities:
            return out
        mu, A = self.mu[:, 0], (self.sign * self.mag)[:, 0]

        def env(x, row):
            return {"r": x, "mu": mu[row], "pi": mu[row] * x, "A": A[row], **self.params}
        _, row, x = _crossings(numpy_plan(*quantities), len(quantities), R, env)
        order = np.lexsort((x, row))
        row, x = row[order], x[order]
        rank = np.arange(row.size) - np.searchsorted(row, row)     # index within its row
        keep = rank < ROW_THRESHOLDS
        for k, side in enumerate(_sides(x[keep], ratio=True)):
            out[row[keep], 2 * rank[keep] + k] = side
        return out

    def _depends_on_magnitude(self, base, mus, mags) -> bool:
        np = self.np
        r, mu = base[None, :], mus[:, None]
        for sign in SIDE_SIGNS:
            ref = self.w(r, mu, sign)
            for mag in np.unique(np.concatenate([mags, np.logspace(-3, 3, 7)])):
                if not np.allclose(self.w(r, mu, sign * mag), ref, rtol=1e-12, atol=0, equal_nan=True):
                    return True
        return False

    def w(self, r, mu, A, dtype=float):
        """w where ℓ and ∂ℓ/∂r are both finite doubles; nan elsewhere (undefined). With
        dtype=np.longdouble, the same rules in extended precision (where the platform has it):
        only to tell a rounding artefact near a zero of w from a zero of w itself."""
        np = self.np
        r, mu, A = np.broadcast_arrays(*(np.asarray(x, dtype=dtype) for x in (r, mu, A)))
        env = {"r": r, "mu": mu, "pi": mu * r, "A": A, **self.params}
        ell, dl = numpy_plan(self.obj.expr, self.dl)(env)
        with np.errstate(all="ignore"):
            ell = np.broadcast_to(ell, r.shape)
            w = np.broadcast_to(dl, r.shape) / A
            return np.where(np.isfinite(ell) & np.isfinite(w), w, np.nan)

    # -------------------------------------------------------------- events
    def _state(self, w):
        """0, ±1 by sign; 2 where undefined."""
        np = self.np
        return np.where(np.isfinite(w), np.sign(w), 2.0)

    def _bisect(self, lo, hi, mu, A, split):
        """Shrink [lo, hi] around an event; split(w_lo, w_mid, w_hi) says, per bracket,
        whether the event lies in the lower half. Returns lo, hi and w at both ends, with
        |w| at both ends a third of the way in (to tell a pole from a finite jump)."""
        np = self.np
        wl, wh = self.w(lo, mu, A), self.w(hi, mu, A)
        early = None
        for i in range(BISECTIONS):
            mid = (lo + hi) / 2
            wm = self.w(mid, mu, A)
            low = split(wl, wm, wh)
            hi, wh = np.where(low, mid, hi), np.where(low, wm, wh)
            lo, wl = np.where(low, lo, mid), np.where(low, wl, wm)
            if i == BISECTIONS // 3:
                early = np.fmax(np.abs(wl), np.abs(wh))
        return lo, hi, wl, wh, early

    def events(self):
        """Every place along a row where w's state (sign, or undefined) changes, or w jumps
        without changing sign: [(row, r_lo, r_hi, w_lo, w_hi, kind)] as arrays."""
        np = self.np
        R, W, S = self.R, self.W, self._state(self.W)
        both_inside = self.inside[:, 1:] & self.inside[:, :-1]
        change = (S[:, 1:] != S[:, :-1]) & both_inside
        with np.errstate(all="ignore"):
            d = np.abs(np.diff(W, axis=1))
            dn = np.fmax(np.pad(d[:, :-1], ((0, 0), (1, 0)), constant_values=0),
                         np.pad(d[:, 1:], ((0, 0), (0, 1)), constant_values=0))
            jump = ~change & both_inside & (d > 4 * np.nan_to_num(dn)) & (d > 1e-9 * self.row_scale)
        # grid points next to an event: where a symbolic weight may take the other branch
        near = np.zeros(R.shape, dtype=bool)
        for m in (change, jump):
            near[:, 1:] |= m
            near[:, :-1] |= m
        self.near_event = near
        out = {}
        for name, mask, split in (("change", change, self._split_state), ("jump", jump, self._split_jump)):
            rows, j = np.nonzero(mask)
            if not rows.size:
                out[name] = None
                continue
            mu, A = self.mu[rows, 0], (self.sign * self.mag)[rows, 0]
            lo, hi, wl, wh, early = self._bisect(R[rows, j], R[rows, j + 1], mu, A, split)
            out[name] = {"row": rows, "lo": lo, "hi": hi, "wl": wl, "wh": wh, "early": early,
                         "mu": mu, "A": A, "gl": S[rows, j], "gh": S[rows, j + 1], "j": j}
        out["peak"] = self._peaks()
        return out

    def _peaks(self):
        """Sharp local maxima of |w| (twice its value two points away on each side), searched
        for a pole between their neighbours: a maximum that keeps growing as the search
        narrows is a pole, even where w does not change sign (1/(r − c)²)."""
        np = self.np
        a = np.where(self.valid, np.abs(self.W), np.nan)
        c = a[:, 2:-2]
        with np.errstate(invalid="ignore"):
            peak = (c > a[:, 1:-3]) & (c >= a[:, 3:-1]) & (c > 2 * np.fmax(a[:, :-4], a[:, 4:])) \
                & (c > self.row_scale)
        rows, j = np.nonzero(peak)
        if not rows.size:
            return None
        j = j + 2
        lo, hi = self.R[rows, j - 1], self.R[rows, j + 1]
        mu, A = self.mu[rows, 0], (self.sign * self.mag)[rows, 0]
        for _ in range(BISECTIONS):     # ternary search for the largest |w| in [lo, hi]
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            f1, f2 = (np.nan_to_num(np.abs(self.w(m, mu, A)), nan=np.inf) for m in (m1, m2))
            lo, hi = np.where(f1 < f2, m1, lo), np.where(f1 < f2, hi, m2)
        top = np.nan_to_num(np.abs(self.w((lo + hi) / 2, mu, A)), nan=np.inf)
        pole = top > 100 * a[rows, j]
        return {"mu": mu[pole], "A": A[pole], "r": ((lo + hi) / 2)[pole]}

    def _split_state(self, wl, wm, wh):
        # keep the half whose ends differ in state, the lower half first
        s = self._state
        return s(wl) != s(wm)

    def _split_jump(self, wl, wm, wh):
        np = self.np
        return np.nan_to_num(np.abs(wm - wl), nan=np.inf) >= np.nan_to_num(np.abs(wh - wm), nan=np.inf)

    def facts(self) -> dict:
        """What the grid shows, per sign of A: where w changes sign (each event's r, μ, |A|
        and kind), where it touches 0, jumps, has a pole or is undefined; and its range."""
        np = self.np
        ev = self.events()
        out = {adv: {"events": [], "touches": [], "poles": [], "undefined": [], "jumps": [], "underflows": []}
               for adv in ("positive", "negative")}
        if ev["peak"] is not None:
            for mu, A, r in zip(ev["peak"]["mu"], ev["peak"]["A"], ev["peak"]["r"]):
                out["positive" if A > 0 else "negative"]["poles"].append({"mu": float(mu), "A": float(A), "r": float(r)})
        found = []
        if ev["change"] is not None:
            e = ev["change"]
            for i in range(e["row"].size):
                found.append((int(e["row"][i]), float(e["lo"][i]), float(e["hi"][i]), float(e["wl"][i]),
                              float(e["wh"][i]), float(e["early"][i]), int(e["gl"][i]), int(e["gh"][i])))
        found = self._merge(found)
        for row, lo, hi, wl, wh, early, gl, gh in found:
            # the kind comes from the states on the grid, not at the bracket's ends: there
            # rounding can make a continuous crossing exactly 0 on one side
            adv = "positive" if self.sign[row, 0] > 0 else "negative"
            where = {"mu": float(self.mu[row, 0]), "A": float((self.sign * self.mag)[row, 0]), "r": (lo + hi) / 2}
            grid_valid = 2 not in (gl, gh)
            sl, sh = (2 if not math.isfinite(x) else int(np.sign(x)) for x in (wl, wh))
            if grid_valid and 2 not in (sl, sh):
                sl, sh = gl, gh
            grows = max(abs(wl) if math.isfinite(wl) else 0, abs(wh) if math.isfinite(wh) else 0) > 100 * early
            if grid_valid and (grows or 2 in (sl, sh)):
                out[adv]["poles"].append(where)     # through infinity (overflowing near it)
            elif 2 in (sl, sh) or 2 in (gl, gh):    # (the bracket may have closed on another change)
                out[adv]["undefined"].append({**where, "below": 2 in (sl, gl), "w_grows": grows})
            elif grows:
                out[adv]["poles"].append(where)
            elif 0 in (sl, sh) and 0 < max(abs(wl), abs(wh)) < UNDERFLOW:
                out[adv]["underflows"].append(where)    # w decays to 0 only as a double
            elif sl == sh:
                out[adv]["touches"].append(where)
            else:
                inner, outer = (sl, sh) if where["r"] > 1 else (sh, sl)
                kind = ("w = 0 beyond" if outer == 0 else "w = 0 before" if inner == 0 else
                        "crosses 0" if max(abs(wl), abs(wh)) <= 1e-6 * float(self.row_scale[row, 0])
                        else "jumps across 0")
                out[adv]["events"].append({**where, "kind": kind, "lo": lo, "hi": hi})
        if ev["jump"] is not None:
            e = ev["jump"]
            with np.errstate(all="ignore"):
                size = np.abs(e["wh"] - e["wl"])
                top = np.fmax(np.abs(e["wl"]), np.abs(e["wh"]))
            edge = self._edge_growth(e)
            for i in np.nonzero(size > 1e-6 * top)[0]:
                adv = "positive" if e["A"][i] > 0 else "negative"
                where = {"mu": float(e["mu"][i]), "A": float(e["A"][i]), "r": float((e["lo"][i] + e["hi"][i]) / 2)}
                if edge[i]:     # steep, continuous growth up to where w ends: not a jump
                    out[adv]["undefined"].append({**where, "below": bool(edge[i] < 0), "w_grows": True})
                else:
                    out[adv]["poles" if top[i] > 100 * e["early"][i] else "jumps"].append(where)
        out["range"] = self._range(out)
        out["continuous"] = not any(out[a][k] for a in ("positive", "negative")
                                    for k in ("jumps", "poles")) and not any(
            e["kind"] == "jumps across 0" or e["kind"].startswith("w = 0") for a in ("positive", "negative")
            for e in out[a]["events"])
        out["points"] = int(self.inside.sum())
        out["undefined_fraction"] = float(1 - self.valid.sum() / max(1, self.inside.sum()))
        return out

    def _edge_growth(self, e):
        """Per jump: +1 (or −1) where the bisection closed on its bracket's upper (lower) grid
        point and w ends just past it (the next grid point is undefined or the row ends) with |w|
        there over 100 times its value at the other grid point and the row's scale: growth
        toward an undefined edge (log(1 − π) as π → 1), which a grid cannot tell from a jump."""
        np = self.np
        rows, j = e["row"], e["j"]
        out = np.zeros(rows.size, dtype=int)
        n = self.R.shape[1]
        for side, at, other, past in ((1, j + 1, j, j + 2), (-1, j, j + 1, j - 1)):
            closed = (e["hi"] if side > 0 else e["lo"]) == self.R[rows, at]
            past_ok = (past >= 0) & (past < n)
            ends = ~past_ok | ~self.valid[rows, np.clip(past, 0, n - 1)]
            big = np.abs(self.W[rows, at]) > 100 * np.fmax(np.abs(self.W[rows, other]), self.row_scale[rows, 0])
            out = np.where((out == 0) & closed & ends & big, side, out)
        return out

    def _merge(self, found):
        """Changes of state along a row that are one zero of w: two at one r (w exactly 0 at a
        grid point between them), or a cluster of continuous ones within CLUSTER of each other
        that extended precision shows to be rounding (cancellation makes w 0 or of either sign
        on a small interval around a touch or a crossing). Merged, a touch has the same sign
        on both sides and a crossing opposite ones."""
        found = sorted(found)
        out = []
        for ev in found:
            if out and out[-1][0] == ev[0] and (
                    (abs(ev[1] - out[-1][2]) <= 1e-9 * max(1.0, ev[1]) and out[-1][4] == 0.0 and ev[3] == 0.0)
                    or self._one_zero(out[-1], ev)):
                row, lo, _, wl, _, early, gl, _ = out.pop()
                out.append((row, lo, ev[2], wl, ev[4], max(early, ev[5]), gl, ev[7]))
            else:
                out.append(ev)
        return out

    def _continuous(self, ev) -> bool:
        row, _, _, wl, wh, _, gl, gh = ev
        return 2 not in (gl, gh) and math.isfinite(wl) and math.isfinite(wh) and \
            max(abs(wl), abs(wh)) <= 1e-6 * float(self.row_scale[row, 0])

    def _one_zero(self, a, b) -> bool:
        """a and b (consecutive on a row) are rounding around one zero: both continuous, close,
        and w in extended precision differs in state from w in doubles somewhere between them
        while it is nowhere 0 on two neighbouring samples (that would be a real interval of 0)."""
        np = self.np
        if not (self._continuous(a) and self._continuous(b)) or b[1] - a[2] > CLUSTER * max(1.0, b[1]):
            return False
        lo, hi = a[1], b[2]
        pad = max(hi - lo, 1e-12 * hi)
        r = np.linspace(max(lo - pad, lo / 2), hi + pad, 65)
        mu, A = self.mu[a[0], 0], (self.sign * self.mag)[a[0], 0]
        s64, sx = self._state(self.w(r, mu, A)), self._state(self.w(r, mu, A, dtype=np.longdouble))
        zero_run = np.any((sx[1:] == 0) & (sx[:-1] == 0))
        return bool(np.any(s64 != sx)) and 2 not in sx and not zero_run

    def _range(self, facts):
        """[lo, hi] of w over the grid; None for a side that is unbounded: w grows toward a
        pole, an edge of the undefined region, or the domain's corners (μ → 0, r → 0 or ∞)."""
        np = self.np
        if not self.valid.any():
            return None
        lo, hi = -self._refined_extreme(-1.0), self._refined_extreme(1.0)
        # beyond the grid's corners (μ down to 1e-12, r down to 1e-15): does w keep growing?
        mus = np.logspace(-16, -13, 4)[:, None]
        pis = np.logspace(-16, 0, 240)[None, :]
        small_r = np.logspace(-20, -16, 5)[None, :]
        ext = []
        for sign in SIDE_SIGNS:
            for mag in sorted(set(MAGNITUDES) | set(self.magnitudes) | set(DENSE_MAGNITUDES * (len(self.magnitudes) > 1))):
                r = pis / mus
                ext.append(self.w(np.where(r == 1, np.nan, r), mus, sign * mag).ravel())
                ext.append(self.w(small_r, np.unique(self.mu)[:, None], sign * mag).ravel())
        for A in (1e-9, -1e-9, 1e9, -1e9):     # |A| → 0 or ∞, for weights that depend on it
            first = self.mag[:, 0] == self.magnitudes[0]
            ext.append(self.w(self.R[first], self.mu[first], A).ravel())
        ext = np.concatenate(ext)
        ext = ext[np.isfinite(ext)]
        unbounded_lo = ext.size and ext.min() < lo - 1e-3 * max(1.0, abs(lo))
        unbounded_hi = ext.size and ext.max() > hi + 1e-3 * max(1.0, abs(hi))
        for adv in ("positive", "negative"):
            near = facts[adv]["poles"] + [u for u in facts[adv]["undefined"] if u["w_grows"]]
            for p in near:
                h = 1e-9 * max(1.0, p["r"])
                for r in (p["r"] - h, p["r"] + h):
                    v = float(self.w(r, p["mu"], p["A"]))
                    unbounded_hi |= math.isfinite(v) and v > 0
                    unbounded_lo |= math.isfinite(v) and v < 0
        if any(facts[adv]["touches"] for adv in ("positive", "negative")):
            lo, hi = min(lo, 0.0), max(hi, 0.0)     # w = 0 exactly there, between grid points
            # an extreme within rounding of 0 beside a touch is the touch's 0 (cancellation
            # leaves −4e-16 where (1.5 − r)² is expanded), not a sign change
            tiny = 1e-12 * float(np.median(self.row_scale))
            lo, hi = (0.0 if abs(x) <= tiny else x for x in (lo, hi))
        unbounded_lo |= lo < -HUGE
        unbounded_hi |= hi > HUGE
        return [None if unbounded_lo else lo, None if unbounded_hi else hi]

    def _refined_extreme(self, s, keep=8):
        """max of s·w: the grid's best points, each improved by a pattern search over log μ,
        log r and log |A| inside the domain, since it can lie between grid points and sampled |A|."""
        np = self.np
        vals = np.where(self.valid, s * self.W, -np.inf)
        top = np.argsort(vals, axis=None)[-keep:]
        rows, cols = np.unravel_index(top, vals.shape)
        free = len(self.magnitudes) > 1          # |A| only where w depends on it
        mus, rs, signs, mags = self.mu[rows, 0], self.R[rows, cols], self.sign[rows, 0], self.mag[rows, 0]
        if free:
            # w may peak or dip between the rows' |A| with no threshold to say where (e^(−(|A| − 10)²)):
            # the best points of a coarse scan over DENSE_MAGNITUDES seed the search too
            m, r, a, g = (c.ravel() for c in np.meshgrid(np.unique(self.mu[:, 0])[::4], np.geomspace(1e-15, 1e12, 55),
                                                          DENSE_MAGNITUDES, SIDE_SIGNS, indexing="ij"))
            v = np.where(m * r <= 1, s * self.w(r, m, g * a), np.nan)
            best = np.argsort(np.where(np.isfinite(v), v, -np.inf))[-keep:]
            mus, rs, signs, mags = (np.concatenate([x, y[best]]) for x, y in ((mus, m), (rs, r), (signs, g), (mags, a)))
        x = np.stack([np.log(mus), np.log(rs)] + [np.log(mags)] * free)
        sign, mag = signs[:, None], mags[:, None]
        span = [math.log(min(MAGNITUDES[0], self.magnitudes[0])), math.log(max(MAGNITUDES[-1], self.magnitudes[-1]))]

        def f(y):
            v = s * self.w(np.exp(y[1]), np.exp(y[0]), sign * (np.exp(y[2]) if free else mag))
            return np.where(np.isfinite(v), v, -np.inf)

        def project(y):
            # inside the grid's domain (μ ≤ 1, π = μ·r ≤ 1, and its corners): what lies beyond
            # is _range's test of whether w keeps growing there
            y[0] = np.clip(y[0], math.log(CORNER_MUS[-1]), 0.0)
            y[1] = np.clip(y[1], math.log(CORNER_RS[0]), -y[0])
            if free:
                y[2] = np.clip(y[2], *span)
            return y
        return max(float(np.max(_climb(f, x, project))), float(np.max(vals[rows, cols])))

    def boundary_at(self, g, events):
        """The events that a candidate boundary g(r, μ, A) = 0 accounts for: g changes sign
        (or is 0) across the event's bracket, widened by 1e-7 relative."""
        np = self.np
        if not events:
            return np.zeros(0, dtype=bool)
        lo, hi = (np.array([e[k] for e in events]) for k in ("lo", "hi"))
        # widened by 1e-7 relative, but never past r = 1: at μ = 1e-12 the boundary r = 1 + μ
        # lies 1e-12 from the seam r = 1, which must not account for it
        h = np.maximum(1e-7 * np.minimum(hi, np.abs((lo + hi) / 2 - 1)), 4 * np.spacing(hi))
        lo, hi = lo - h, hi + h
        mu, A = np.array([e["mu"] for e in events]), np.array([e["A"] for e in events])
        with np.errstate(all="ignore"):
            gl, gh = np.broadcast_to(g(lo, mu, A), lo.shape), np.broadcast_to(g(hi, mu, A), lo.shape)
        return (np.sign(gl) != np.sign(gh)) & np.isfinite(gl) & np.isfinite(gh) | (gl == 0) | (gh == 0)

    def changes_sign_at(self, r, mu, A):
        """Outside the domain too: does w change state across r (relative 1e-7)? Returns that,
        where w is defined on both sides at all (ℓ may overflow a double out there), and each
        point's kind, from probing it: w = 0 on the side away from r = 1 ("w = 0 beyond") or
        toward it ("w = 0 before"), else a sign change, continuous or not."""
        np = self.np
        h = 1e-7 * np.maximum(r, 1.0)
        with np.errstate(invalid="ignore"):         # a candidate's r*(μ, A) may be inf or nan there
            s = self._state(self.w(r - h, mu, A)), self._state(self.w(r + h, mu, A))
            defined = (s[0] != 2) & (s[1] != 2) & np.isfinite(r) & (r - h > 0)
        changed = (s[0] != s[1]) & defined
        return changed, defined, self.kind_at(r, mu, A, s)

    def kind_at(self, r, mu, A, states):
        """The label of a sign change at r from w on both sides: |w| 1e-9 away against |w| 1e-3
        away tells a continuous crossing (w → 0 at r) from a jump across 0."""
        np = self.np
        sl, sh = states
        inner, outer = np.where(r > 1, sl, sh), np.where(r > 1, sh, sl)
        with np.errstate(all="ignore"):
            near = np.fmax(*(np.abs(self.w(r * (1 + d), mu, A)) for d in (-1e-9, 1e-9)))
            far = np.fmax(*(np.abs(self.w(r * (1 + d), mu, A)) for d in (-1e-3, 1e-3)))
        crosses = np.nan_to_num(near, nan=np.inf) <= 1e-3 * np.nan_to_num(far, nan=0.0)
        return np.where(outer == 0, "w = 0 beyond", np.where(inner == 0, "w = 0 before",
                                                              np.where(crosses, "crosses 0", "jumps across 0")))

def describe(points) -> str:
    """Where a set of located events lies, in the simplest coordinate that is constant over
    them: r, π, or π − μ; else the span of r."""
    if not points:
        return ""
    rs = [p["r"] for p in points]
    pis = [p["r"] * p["mu"] for p in points]
    diffs = [p - p_["mu"] for p, p_ in zip(pis, points)]
    same = lambda xs: max(xs) - min(xs) <= 1e-6 * max(1.0, max(map(abs, xs)))   # noqa: E731
    if same(rs):
        return f"r ≈ {rs[0]:.6g} (π ≈ {rs[0]:.6g}·μ)"
    if same(pis):
        return f"π ≈ {pis[0]:.6g}"
    if same(diffs):
        return f"π ≈ μ {'+' if diffs[0] >= 0 else '−'} {abs(diffs[0]):.6g}"
    return f"r from {min(rs):.6g} to {max(rs):.6g} as μ and |A| vary (π from {min(pis):.3g} to {max(pis):.3g})"
