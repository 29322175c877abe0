"""The numeric arbiter's grid: where w = (∂ℓ/∂r)/A is sampled and what it is there, by the
IR's own float rules (the rules the compiled loss follows), never by SymPy, so that its facts
check the symbolic derivation independently. One row per (sign of A, |A|, μ) over
0 < μ ≤ 1, 0 < π ≤ 1, with r ascending; beside a regular grid, both sides of every threshold
the objective itself compares (a condition, a clip, a min or max) and the domain's corners.
What happens along the rows (sign changes, jumps, poles, undefined edges) is analysis.numeric.events';
w's extremes (its range, and the on-policy weight at r = 1) are analysis.numeric.extremes'."""
from __future__ import annotations

import functools
import math
import warnings

from dsl.ir import ZERO, Node, postorder
from dsl.operations import OPS
from dsl.walks import numpy_plan

# μ across six decades and |A| across six: a value that holds on all of them is reported as a
# number, one that does not as the interval it spans
MUS = (1e-6, 1e-3, 0.1, 0.5, 1.0)
MAGNITUDES = (1e-3, 1.0, 1e3)
# where w depends on |A| smoothly (no threshold says where it changes): quarter decades over MAGNITUDES'
# span, for the candidates' probes and the range's search
DENSE_MAGNITUDES = tuple(10 ** (k / 4) for k in range(-12, 13))
SIGNS = (("positive", 1.0), ("negative", -1.0))
SIDE_SIGNS = tuple(sign for _, sign in SIGNS)
# the domain's corners beyond the regular grid: μ → 0 with r up to 1/μ (a clamp at |log r| = 12
# is met only there), and r → 0
CORNER_MUS = (2.7e-10, 1.3e-12)     # not round: a threshold on π at a round value stays off r = 1
CORNER_RS = (1e-15, 1e-12, 1e-9, 1e4, 1e5, 3e5, 1e6, 1e7, 3e7, 1e8, 1e9, 1e10, 1e11, 1e12)


# ------------------------------------------------------------------ structure
# Where the objective itself says things change: every quantity it compares (a condition, a
# clip, a min or max). One that reads only |A|, only μ, only r or only π has thresholds found
# once along that variable; one that reads r or π with μ or A (π − μ ≤ 0.1) has them per row.
THRESHOLD_SAMPLES = 2001    # points of each one-variable search for a threshold
ROW_QUANTITIES = 8          # compared quantities in r searched per row; past it, the grid alone
ROW_THRESHOLDS = 4          # thresholds in r added per row (a point either side of each)
BAND_THRESHOLDS = 6         # thresholds on |A| or μ given rows of their own (either side, and inside)


def params_key(params):
    return tuple(sorted(params.items()))


def _compared(*roots):
    """(a − b, the variables it reads) for every pair the objective compares: each comparison,
    each pair of a min or max, a clip's argument against either bound; and apart, each divisor
    against 0 (where a pole may lie: analysis.numeric.events probes it, the grid does not take it in)."""
    reads, out, divisors, seen = {ZERO: frozenset()}, [], [], set()
    for m in postorder(Node("tuple", roots)):
        reads[m] = frozenset([m.value]) if m.op == "var" else frozenset().union(*(reads[a] for a in m.args))
        pairs = OPS[m.op].compares(*m.args) if m.op in OPS and OPS[m.op].compares else []
        for a, b in pairs:
            if reads[a] | reads[b] and (a, b) not in seen:
                seen.add((a, b))
                (out if OPS[m.op].branching else divisors).append((Node("sub", (a, b)), reads[a] | reads[b]))
    return out, divisors


def state(v):
    """0, ±1 by sign; 2 where undefined."""
    import numpy as np
    return np.where(np.isfinite(v), np.sign(v), 2.0)


def _crossings(run, k, xs, env):
    """(quantity, row, x) arrays: where each of run's k quantities changes sign (or
    definedness) along each row of xs (ascending, nan past the row's end), each bracket halved
    BISECTIONS times; env(x, row) is the environment at x on that row."""
    import numpy as np
    xs = np.atleast_2d(xs)

    def states(x, row):
        return state(np.stack([np.broadcast_to(q, x.shape) for q in run(env(x, row))]))
    s = states(xs, np.arange(xs.shape[0])[:, None])
    both = ~np.isnan(xs[:, 1:]) & ~np.isnan(xs[:, :-1])
    i, row, j = np.nonzero((s[:, :, 1:] != s[:, :, :-1]) & both)
    lo, hi, sl = xs[row, j], xs[row, j + 1], s[i, row, j]
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        low = states(mid, row)[i, np.arange(i.size)] != sl
        lo, hi = np.where(low, lo, mid), np.where(low, mid, hi)
    return i, row, (lo + hi) / 2


POLE_STEPS = (1e-9, 1e-11, 1e-13)   # relative distances from a divisor's zero, each 100 times closer
SIDE = 1e-6     # a threshold's two sides, relative to it: clear of a derived formula's rounding


def _first_per_row(row, x, n):
    """(row, x, rank within its row) of each row's first n places, ascending, each place once: a
    quantity exactly 0 at a grid point (|π − μ| = 0.5·μ at r = 0.5) changes state on both sides of
    it, and two such pairs filled a row's four (r = 1.5 lost). (Both are bisected to an ulp.)"""
    import numpy as np
    order = np.lexsort((x, row))
    row, x = row[order], x[order]
    again = np.zeros(row.size, dtype=bool)
    again[1:] = (row[1:] == row[:-1]) & (x[1:] - x[:-1] <= 1e-12 * np.abs(x[1:]))
    row, x = row[~again], x[~again]
    rank = np.arange(row.size) - np.searchsorted(row, row)
    keep = rank < n
    return row[keep], x[keep], rank[keep]


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
    "rows", the quantities that read r or π with μ or A (searched per row by the Arbiter); and
    "divisors", those divisors that read r or π (analysis.numeric.events' poles)."""
    import numpy as np
    params = dict(params)
    groups = {}
    branches, divisors = _compared(expr, dl)
    for q, reads in branches:
        name = (next(iter(reads)) if len(reads) == 1 else "muA" if reads == {"mu", "A"} else "rows")
        groups.setdefault(name, []).append(q)
    n = THRESHOLD_SAMPLES
    unit = np.unique(np.concatenate([np.logspace(-15, 0, n), np.linspace(0, 1, n)[1:]]))
    axes = {"A": np.logspace(-6, 6, n), "mu": unit, "pi": unit,
            "r": np.unique(np.concatenate([np.logspace(-15, 15, n), np.linspace(0, 3, n)[1:]]))}

    def search(qs, var, fixed=None):
        run = numpy_plan(*qs)
        signs = SIDE_SIGNS if var == "A" else (1.0,)
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
            found["mu"] += [x for s in SIDE_SIGNS for x in search(groups["muA"], "mu", {"A": s * mag})]
        found["mu"] = _bands(found["mu"])
    return {**{v: np.array(sorted(set(x)), dtype=float) for v, x in found.items()},
            "rows": tuple(groups.get("rows", ())[:ROW_QUANTITIES]),
            "divisors": tuple(q for q, reads in divisors if reads & {"r", "pi"})[:ROW_QUANTITIES]}


def _bands(xs):
    """The first BAND_THRESHOLDS thresholds' sides (xs holds them in pairs), with the geometric
    middle of each band between two of them."""
    xs = sorted(set(xs))[:2 * BAND_THRESHOLDS]
    return xs + [math.sqrt(a * b) for a, b in zip(xs[1:-1:2], xs[2::2])]


# ------------------------------------------------------------------ the grid
GRID_NODE_POINTS = 3e7      # grid points × IR nodes per evaluation: bounds the arbiter's time
BISECTIONS = 60             # halvings of a bracket: from 1e-3 wide to below a double's resolution


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
    |A|, μ) with r ascending: R (nan past a row's end), W = w there (nan where undefined),
    valid, inside, the rows' mu, sign, mag and row_scale, and w(r, μ, A) anywhere. The
    events along its rows are located by analysis.numeric.events, w's extremes by openrlhf_drpo.analysis.numeric.extremes."""

    def __init__(self, obj, dl):
        import numpy as np
        self.np, self.obj, self.dl = np, obj, dl
        self.params = {k: float(v) for k, v in obj.params.items()}
        found = thresholds(obj.expr, dl, params_key(self.params))
        self.found = found
        self.row_quantities = found["rows"]
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
        # (at the corners' μ, the last r before 1/μ is 1e11: a band at π − μ ≈ 0.3 beyond it is
        # extremes.w_range's, which searches it as μ → 0)
        R = np.concatenate([R, found["pi"][None, :] / self.mu,
                            self.row_thresholds(R, self.mu[:, 0], (self.sign * self.mag)[:, 0], found["rows"]),
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

    def row_thresholds(self, R, mu, A, quantities):
        """Both sides of each place along a row (r ascending, at μ and A per row) where a
        compared quantity that reads r with μ or A (|π − μ| ≤ 0.1, A·(r − 1) ≤ 0) changes
        sign: the first ROW_THRESHOLDS per row."""
        np = self.np
        out = np.full((R.shape[0], 2 * ROW_THRESHOLDS), np.nan)
        if not quantities:
            return out

        def env(x, row):
            return {"r": x, "mu": mu[row], "pi": mu[row] * x, "A": A[row], **self.params}
        # r = 1 searched too (w is not sampled there, the quantities are): a band |log r| ≤ 0.0025
        # lies between the grid's neighbours of r = 1, and only r = 1 shows both its edges
        R = np.sort(np.concatenate([R, np.ones((R.shape[0], 1))], axis=1), axis=1)
        _, row, x = _crossings(numpy_plan(*quantities), len(quantities), R, env)
        row, x, rank = _first_per_row(row, x, ROW_THRESHOLDS)
        for k, side in enumerate(_sides(x, ratio=True)):
            out[row, 2 * rank + k] = side
        return out

    def divisor_poles(self):
        """Poles where a divisor that reads r or π is 0 along a row: |w| beside its zero grows at
        least 5-fold each time the distance shrinks 100-fold (1/x 100-fold, 1/√x 10-fold), on either
        side, w defined on both; a zero the numerator shares (sin(x)/x) stays finite. OTB's
        4AW/(8W + 1e-8) with W < 0 has a pole 1e-9 wide in π, between the grid's points.
        [(row, r, the sign of w toward it)], one per side that grows."""
        np = self.np
        if not self.found["divisors"]:
            return []
        mu, A = self.mu[:, 0], (self.sign * self.mag)[:, 0]

        def env(x, row):
            return {"r": x, "mu": mu[row], "pi": mu[row] * x, "A": A[row], **self.params}
        _, row, x = _crossings(numpy_plan(*self.found["divisors"]), len(self.found["divisors"]), self.R, env)
        out = []
        with np.errstate(all="ignore"):
            w = np.stack([[self.w(x * (1 + side * h), mu[row], A[row]) for h in POLE_STEPS] for side in (-1.0, 1.0)])
            # w defined on both sides: a divisor's zero at an edge of the undefined region
            # (d log(r − 0.5)/dr = 1/(r − 0.5)) is that edge's, which events classifies
            inside = np.all(np.isfinite(w), axis=(0, 1))
            for a, v in zip(np.abs(w), w):
                grows = inside & (a[1] > 5 * a[0]) & (a[2] > 5 * a[1])
                out += [(int(i), float(r), float(np.sign(s))) for i, r, s in zip(row[grows], x[grows], v[2][grows])]
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
