"""The numeric arbiter: facts about an objective found with the IR's own float rules (the
rules the compiled loss follows), never with SymPy, so that they check the symbolic
derivation independently: the on-policy weight, and on a dense (μ, π) grid for both signs
of A and several |A|, the weight itself, where it changes sign, jumps or has a pole, where
ℓ or w is undefined, and its range."""
from __future__ import annotations

import math
import warnings

from .ir import derivative, numpy_plan

# μ across six decades and |A| across six: a value that holds on all of them is reported as a
# number, one that does not as the interval it spans
MUS = (1e-6, 1e-3, 0.1, 0.5, 1.0)
MAGNITUDES = (1e-3, 1.0, 1e3)
SIGNS = (("positive", 1.0), ("negative", -1.0))


def on_policy(obj) -> dict:
    """w and ℓ at r = 1 (π = μ), per sign of A: what the first mini-batch of every PPO-style
    step sees. status: "ok" (w > 0), "zero" (no on-policy gradient), "negative" (the gradient
    opposes A), "undefined" (ℓ or w is 0/0, a pole, or not a finite double there)."""
    import numpy as np
    run = numpy_plan(obj.expr, derivative(obj.expr))     # ∂ℓ/∂r at fixed μ and A, by the IR's rules
    params = {k: float(v) for k, v in obj.params.items()}
    mu, mag = (x.ravel() for x in np.meshgrid(MUS, MAGNITUDES))
    out = {}
    for adv, sign in SIGNS:
        A = sign * mag
        ell, dl = (np.broadcast_to(v, mu.shape) for v in run({"r": np.ones_like(mu), "mu": mu, "pi": mu, "A": A,
                                                                **params}))
        with np.errstate(all="ignore"):
            w = dl / A
        undefined = ("ℓ is not finite" if not np.isfinite(ell).all() else
                     "w is 0/0, a pole or not finite" if not np.isfinite(w).all() else None)
        ws = w[np.isfinite(w) & np.isfinite(ell)]
        lo, hi = (float(ws.min()), float(ws.max())) if ws.size else (None, None)
        status = ("undefined" if undefined else "zero" if hi == lo == 0 else
                  "negative" if lo < 0 else "zero" if lo == 0 else "ok")
        # continuous at r = 1 where defined: w there is the limit from both sides
        near = [np.broadcast_to(run({"r": r, "mu": mu, "pi": mu * r, "A": A, **params})[1], mu.shape) / A
                for r in (1 - 1e-12, 1 + 1e-12)]
        with np.errstate(all="ignore"):
            jumps = [np.abs(x - w) > 1e-6 * np.maximum(1.0, np.abs(w)) for x in near]
        out[adv] = {"w": [lo, hi], "status": status, "why": undefined,
                    "jumps": bool(np.any(np.isfinite(w) & (jumps[0] | jumps[1])))}
    return out


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

    def __init__(self, obj):
        import numpy as np
        self.np, self.obj = np, obj
        self.dl = derivative(obj.expr)
        self.params = {k: float(v) for k, v in obj.params.items()}
        mus, base = grid_axes(len(set(obj.expr.walk()) | set(self.dl.walk())), len(MAGNITUDES))
        base = base[base != 1.0]            # r = 1 itself is the on-policy check's
        # other |A| only where w depends on |A|: probed on every third μ first
        mags = MAGNITUDES if self._depends_on_magnitude(base, mus[::3]) else (1.0,)
        rows = [(sg, mag, mu) for sg in SIDE_SIGNS for mag in mags for mu in mus]
        self.sign, self.mag, self.mu = (np.array(c)[:, None] for c in zip(*rows))
        self.magnitudes = mags
        R = np.tile(np.append(base, np.nan), (len(rows), 1))
        cap = 1 / self.mu
        R[R > cap * (1 + 1e-12)] = np.nan                        # π > 1 is outside the domain
        R[:, -1] = np.where(cap[:, 0] > 1, cap[:, 0], np.nan)    # π = 1 exactly (r = 1 is not sampled)
        self.R = np.sort(R, axis=1)                              # nan last
        self.W = self.w(self.R, self.mu, self.sign * self.mag)
        self.valid = np.isfinite(self.W)
        self.inside = ~np.isnan(self.R)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # a row where w is nowhere nonzero
            a = np.where(self.valid, np.abs(self.W), np.nan)
            self.row_scale = np.nan_to_num(np.nanmedian(np.where(a > 0, a, np.nan), axis=1), nan=1.0)[:, None]

    def _depends_on_magnitude(self, base, mus) -> bool:
        np = self.np
        r, mu = base[None, :], mus[:, None]
        for sign in SIDE_SIGNS:
            ref = self.w(r, mu, sign)
            for mag in MAGNITUDES:
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
        mus = np.logspace(-12, -7, 6)[:, None]
        pis = np.logspace(-12, 0, 240)[None, :]
        small_r = np.logspace(-12, -7, 6)[None, :]
        ext = []
        for sign in SIDE_SIGNS:
            for mag in MAGNITUDES:
                r = pis / mus
                ext.append(self.w(np.where(r == 1, np.nan, r), mus, sign * mag).ravel())
                ext.append(self.w(small_r, np.unique(self.mu)[:, None], sign * mag).ravel())
        for A in (1e-9, -1e-9, 1e9, -1e9):     # |A| → 0 or ∞, for weights that depend on it
            ext.append(self.w(self.R[::len(MAGNITUDES)], self.mu[::len(MAGNITUDES)], A).ravel())
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

    def _refined_extreme(self, s, keep=8, steps=60):
        """max of s·w: the grid's best points, each improved by a pattern search over log μ,
        log r and log |A| inside the domain (all directions, diagonals too: an extreme can sit
        on a ridge such as r = |A|), since it can lie between grid points and sampled |A|."""
        np = self.np
        vals = np.where(self.valid, s * self.W, -np.inf)
        top = np.argsort(vals, axis=None)[-keep:]
        rows, cols = np.unravel_index(top, vals.shape)
        x = np.stack([np.log(self.mu[rows, 0]), np.log(self.R[rows, cols]), np.log(self.mag[rows, 0])])
        sign, best = self.sign[rows, 0], vals[rows, cols]
        free = 3 if len(self.magnitudes) > 1 else 2         # |A| only where w depends on it
        dirs = np.array(np.meshgrid(*[[-1.0, 0.0, 1.0]] * free)).reshape(free, -1)
        dirs = np.vstack([dirs[:, np.any(dirs != 0, axis=0)], np.zeros((3 - free, 3 ** free - 1))])
        step = np.full(rows.size, 0.05)
        with np.errstate(all="ignore"):
            for _ in range(steps):
                y = x[:, :, None] + step[None, :, None] * dirs[:, None, :]      # (3, points, directions)
                y[0] = np.minimum(y[0], 0.0)                                   # μ ≤ 1
                y[1] = np.minimum(y[1], -y[0])                                 # π = μ·r ≤ 1
                y[2] = np.clip(y[2], math.log(MAGNITUDES[0]), math.log(MAGNITUDES[-1]))
                v = s * self.w(np.exp(y[1]), np.exp(y[0]), sign[:, None] * np.exp(y[2]))
                v = np.where(np.isfinite(v), v, -np.inf)
                k = np.argmax(v, axis=1)
                gain = v[np.arange(rows.size), k]
                better = gain > best
                x[:, better] = y[:, better, k[better]]
                best = np.where(better, gain, best)
                step = np.where(better, step, step / 2)
        return float(np.max(best))

    def boundary_at(self, g, events):
        """The events that a candidate boundary g(r, μ, A) = 0 accounts for: g changes sign
        (or is 0) across the event's bracket, widened by 1e-7 relative."""
        np = self.np
        if not events:
            return np.zeros(0, dtype=bool)
        lo = np.array([e["lo"] for e in events]) * (1 - 1e-7)
        hi = np.array([e["hi"] for e in events]) * (1 + 1e-7)
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
