"""What happens along the arbiter's rows, and what kind of thing it is. Every place where w's state
(its sign, or undefined) changes, where w jumps without changing sign, or where |w| peaks into a pole
is located by bisection on the IR's own rules; each is then classified per sign of A as a sign change
(crossing, jump across 0, w = 0 beyond or before), a touch of 0, an underflow, a jump, a pole or an
edge of the undefined region. Also here: which located events a candidate boundary accounts for,
whether w changes sign across a given r (analysis.symbolic.confirm's), where events lie, in words."""
from __future__ import annotations

import math

from openrlhf_drpo.analysis.numeric.arbiter import BISECTIONS, state
from dsl.walks import numpy_plan
from openrlhf_drpo.analysis.numeric.extremes import HUGE, w_range

UNDERFLOW = 1e-200          # |w| this small beside an exact 0: a double's underflow (e^-745), not a mask
CLUSTER = 1e-4              # relative: changes of state this close may be rounding around one zero


def _bisect(arb, lo, hi, mu, A, split):
    """Shrink [lo, hi] around an event; split(w_lo, w_mid, w_hi) says, per bracket,
    whether the event lies in the lower half. Returns lo, hi and w at both ends, with
    |w| at both ends a third of the way in (to tell a pole from a finite jump) and the
    difference of w across the bracket then (a continuous change shrinks from it)."""
    np = arb.np
    wl, wh = arb.w(lo, mu, A), arb.w(hi, mu, A)
    early = gap = None
    for i in range(BISECTIONS):
        mid = (lo + hi) / 2
        wm = arb.w(mid, mu, A)
        low = split(wl, wm, wh)
        hi, wh = np.where(low, mid, hi), np.where(low, wm, wh)
        lo, wl = np.where(low, lo, mid), np.where(low, wl, wm)
        if i == BISECTIONS // 3:
            early = np.fmax(np.abs(wl), np.abs(wh))
            gap = np.abs(wh - wl)
    return lo, hi, wl, wh, early, gap


def bisect_change(arb, lo, hi, mu, A):
    """Each bracket [lo, hi] shrunk around the change of w's state within it, as the grid's are."""
    return _bisect(arb, lo, hi, mu, A, _split_state)[:2]


def locate(arb):
    """Every place along a row where w's state (sign, or undefined) changes, or w jumps
    without changing sign: [(row, r_lo, r_hi, w_lo, w_hi, kind)] as arrays."""
    np = arb.np
    R, W, S = arb.R, arb.W, state(arb.W)
    both_inside = arb.inside[:, 1:] & arb.inside[:, :-1]
    change = (S[:, 1:] != S[:, :-1]) & both_inside
    with np.errstate(all="ignore"):
        d = np.abs(np.diff(W, axis=1))
        dn = np.fmax(np.pad(d[:, :-1], ((0, 0), (1, 0)), constant_values=0),
                     np.pad(d[:, 1:], ((0, 0), (0, 1)), constant_values=0))
        jump = ~change & both_inside & (d > 4 * np.nan_to_num(dn)) & (d > 1e-9 * arb.row_scale)
    # grid points next to an event: where a symbolic weight may take the other branch
    near = np.zeros(R.shape, dtype=bool)
    for m in (change, jump):
        near[:, 1:] |= m
        near[:, :-1] |= m
    arb.near_event = near       # kept on the grid: analysis.symbolic.confirm's weight check skips these points
    out = {}
    for name, mask, split in (("change", change, _split_state), ("jump", jump, _split_jump)):
        rows, j = np.nonzero(mask)
        if not rows.size:
            out[name] = None
            continue
        mu, A = arb.mu[rows, 0], (arb.sign * arb.mag)[rows, 0]
        lo, hi, wl, wh, early, gap = _bisect(arb, R[rows, j], R[rows, j + 1], mu, A, split)
        out[name] = {"row": rows, "lo": lo, "hi": hi, "wl": wl, "wh": wh, "early": early, "gap": gap,
                     "mu": mu, "A": A, "gl": S[rows, j], "gh": S[rows, j + 1], "j": j}
    out["peak"] = _peaks(arb)
    return out


def _peaks(arb):
    """Sharp local maxima of |w| (twice its value two points away on each side), searched
    for a pole between their neighbours: a maximum that keeps growing as the search
    narrows is a pole, even where w does not change sign (1/(r − c)²)."""
    np = arb.np
    a = np.where(arb.valid, np.abs(arb.W), np.nan)
    c = a[:, 2:-2]
    with np.errstate(invalid="ignore"):
        peak = (c > a[:, 1:-3]) & (c >= a[:, 3:-1]) & (c > 2 * np.fmax(a[:, :-4], a[:, 4:])) \
            & (c > arb.row_scale)
    rows, j = np.nonzero(peak)
    if not rows.size:
        return None
    j = j + 2
    lo, hi = arb.R[rows, j - 1], arb.R[rows, j + 1]
    mu, A = arb.mu[rows, 0], (arb.sign * arb.mag)[rows, 0]
    early = None
    for i in range(BISECTIONS):     # ternary search for the largest |w| in [lo, hi]
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        f1, f2 = (np.nan_to_num(np.abs(arb.w(m, mu, A)), nan=np.inf) for m in (m1, m2))
        lo, hi = np.where(f1 < f2, m1, lo), np.where(f1 < f2, hi, m2)
        if i == 2 * BISECTIONS // 3:    # the bracket 1e-7 of its width: a finite peak is resolved by now
            early = np.fmax(f1, f2)
    top = np.nan_to_num(np.abs(arb.w((lo + hi) / 2, mu, A)), nan=np.inf)
    # a pole keeps growing as the bracket shrinks 3e3-fold over the last 20 steps (1/(r − c) by
    # 3e3, 1/√|r − c| by 55); a sharp finite peak (sech² at |A| = 1000, a bump 1e-3 wide) stops
    pole = (top > 100 * a[rows, j]) & ((top > 10 * early) | (top > HUGE))
    return {"mu": mu[pole], "A": A[pole], "r": ((lo + hi) / 2)[pole]}


def _split_state(wl, wm, wh):
    # keep the half whose ends differ in state, the lower half first
    return state(wl) != state(wm)


def _split_jump(wl, wm, wh):
    import numpy as np
    return np.nan_to_num(np.abs(wm - wl), nan=np.inf) >= np.nan_to_num(np.abs(wh - wm), nan=np.inf)


def facts(arb) -> dict:
    """What the grid shows, per sign of A: where w changes sign (each event's r, μ, |A|
    and kind), where it touches 0, jumps, has a pole or is undefined; and its range (by
    analysis.numeric.extremes, which reads the poles and undefined edges found here)."""
    np = arb.np
    ev = locate(arb)
    out = {adv: {"events": [], "touches": [], "poles": [], "undefined": [], "jumps": [], "underflows": [], "rounding": []}
           for adv in ("positive", "negative")}
    if ev["peak"] is not None:
        for mu, A, r in zip(ev["peak"]["mu"], ev["peak"]["A"], ev["peak"]["r"]):
            out["positive" if A > 0 else "negative"]["poles"].append({"mu": float(mu), "A": float(A), "r": float(r)})
    for row, r, towards in arb.divisor_poles():
        adv = "positive" if arb.sign[row, 0] > 0 else "negative"
        out[adv]["poles"].append({"mu": float(arb.mu[row, 0]), "A": float((arb.sign * arb.mag)[row, 0]), "r": r,
                                  "towards": towards})
    found = []
    if ev["change"] is not None:
        e = ev["change"]
        for i in range(e["row"].size):
            found.append((int(e["row"][i]), float(e["lo"][i]), float(e["hi"][i]), float(e["wl"][i]),
                          float(e["wh"][i]), float(e["early"][i]), int(e["gl"][i]), int(e["gh"][i])))
    # a change closed onto π = 1 itself (the row's last point): w differs only at the domain's
    # edge, and what lies beyond it (π > 1) holds no token, so it is no boundary met there
    # (a clip bound min(1.105, 1/μ) is 1/μ for μ > 0.905); candidates on it are probed outside
    # (where w is defined on both sides: w undefined at π = 1, log(1 − π), is an edge of its own)
    found = [f for f in found if not (f[2] == 1 / float(arb.mu[f[0], 0]) and np.nextafter(f[2], 0) <= f[1]
                                      and 2 not in (f[6], f[7]))]
    found = _merge(arb, found)
    rounding = rounded(arb, *(np.array([f[k] for f in found], dtype=float) for k in (1, 2)),
                       *(x[np.array([f[0] for f in found], dtype=int), 0] for x in (arb.mu, arb.sign * arb.mag)))
    for (row, lo, hi, wl, wh, early, gl, gh), is_rounding in zip(found, rounding):
        # the kind comes from the states on the grid, not at the bracket's ends: there
        # rounding can make a continuous crossing exactly 0 on one side
        adv = "positive" if arb.sign[row, 0] > 0 else "negative"
        where = {"mu": float(arb.mu[row, 0]), "A": float((arb.sign * arb.mag)[row, 0]), "r": (lo + hi) / 2}
        grid_valid = 2 not in (gl, gh)
        sl, sh = (2 if not math.isfinite(x) else int(np.sign(x)) for x in (wl, wh))
        if grid_valid and 2 not in (sl, sh):
            sl, sh = gl, gh
        grows = max(abs(wl) if math.isfinite(wl) else 0, abs(wh) if math.isfinite(wh) else 0) > 100 * early
        if grid_valid and (grows or 2 in (sl, sh)):
            out[adv]["poles"].append(where)     # through infinity (overflowing near it)
        elif 2 in (sl, sh) or 2 in (gl, gh):    # (the bracket may have closed on another change)
            below = 2 in (sl, gl)
            towards = 0 if grows else _grows_toward(arb, row, hi if below else lo, 1 if below else -1)
            out[adv]["undefined"].append({**where, "below": below, "w_grows": grows or bool(towards),
                                          **({"towards": towards} if towards else {})})
        elif grows:
            out[adv]["poles"].append(where)
        elif 0 in (sl, sh) and 0 < max(abs(wl), abs(wh)) < UNDERFLOW:
            out[adv]["underflows"].append(where)    # w decays to 0 only as a double
        elif sl == sh:
            out[adv]["touches"].append(where)
        elif is_rounding:
            out[adv]["rounding"].append(where)      # a cancellation or an underflow: not a zero of w
        else:
            inner, outer = (sl, sh) if where["r"] > 1 else (sh, sl)
            kind = ("w = 0 beyond" if outer == 0 else "w = 0 before" if inner == 0 else
                    "crosses 0" if _shrank(arb, row, wl, wh, early) else "jumps across 0")
            out[adv]["events"].append({**where, "kind": kind, "lo": lo, "hi": hi})
    if ev["jump"] is not None:
        e = ev["jump"]
        with np.errstate(all="ignore"):
            size = np.abs(e["wh"] - e["wl"])
            top = np.fmax(np.abs(e["wl"]), np.abs(e["wh"]))
        edge = _edge_growth(arb, e)
        # a jump keeps its size as the bracket is halved 40 more times; a steep continuous
        # change (slope 1e3 where w is 1e-40 elsewhere on the row) shrinks with it
        shrank = size <= 1e-3 * e["gap"]
        for i in np.nonzero(size > 1e-6 * top)[0]:
            adv = "positive" if e["A"][i] > 0 else "negative"
            where = {"mu": float(e["mu"][i]), "A": float(e["A"][i]), "r": float((e["lo"][i] + e["hi"][i]) / 2)}
            if edge[i]:     # steep, continuous growth up to where w ends: not a jump
                out[adv]["undefined"].append({**where, "below": bool(edge[i] < 0), "w_grows": True})
            elif not shrank[i]:
                out[adv]["poles" if top[i] > 100 * e["early"][i] else "jumps"].append(where)
    out["range"] = w_range(arb, out)
    out["continuous"] = not any(out[a][k] for a in ("positive", "negative")
                                for k in ("jumps", "poles")) and not any(
        e["kind"] == "jumps across 0" or e["kind"].startswith("w = 0") for a in ("positive", "negative")
        for e in out[a]["events"])
    out["points"] = int(arb.inside.sum())
    out["undefined_fraction"] = float(1 - arb.valid.sum() / max(1, arb.inside.sum()))
    return out


def rounded(arb, lo, hi, mu, A) -> list:
    """Per sign change in [lo, hi] at μ, A (arrays): whether doubles show it and extended precision does
    not: there w keeps one nonzero sign across the bracket (widened by 1e-9 relative), so the
    doubles' change is the rounding of a cancellation (1 − σ read as 0 past r ≈ 38) or of an
    underflow (−1e-320 next to +2e-323), not a zero of w. Unless, a little farther out (up to
    1e-5 relative), doubles and long double agree on w's value (to half of it) and its states
    differ on the two sides: a flat zero, w ~ (r − 1.655)³, is below long double's own rounding
    1e-9 away and a plain sign change 1e-7 away. Where numpy's long double is a double, nothing is
    told apart. (One evaluation for all: 40 masks' 3,000 edges took 0.6 s one by one.)"""
    np = arb.np
    if not len(lo) or np.finfo(np.longdouble).eps >= np.finfo(float).eps:
        return [False] * len(lo)
    mu, A = np.asarray(mu)[None, :], np.asarray(A)[None, :]
    real = np.zeros(len(lo), dtype=bool)
    with np.errstate(all="ignore"):
        for k, widen in enumerate(10.0 ** np.arange(-9, -4)):
            pad = np.maximum(hi - lo, widen * np.maximum(np.abs(lo), np.abs(hi)))
            # never below r = 0: a cluster merged from 1e-6 to 5e-4 padded by its width would read
            # w at r < 0 (undefined) and keep the doubles' rounding as a boundary
            r = np.stack([np.maximum(lo - pad, lo / 2), hi + pad])
            wide = arb.w(r.astype(np.longdouble), mu, A, dtype=np.longdouble)
            s = state(wide)
            if k == 0:
                kept = (s[0] == s[1]) & ((s[0] == 1) | (s[0] == -1))
            w64 = arb.w(r, mu, A)
            agree = np.all((state(w64) == s) & (np.abs(w64 - wide) <= 0.5 * np.abs(wide)), axis=0)
            real |= agree & (s[0] != s[1]) & (s[0] != 2) & (s[1] != 2)
    return [bool(x) for x in kept & ~real]


def _grows_toward(arb, row, edge, side) -> int:
    """+1 or −1 where w diverges upward or downward as r approaches an edge of the undefined
    region from its defined side (side +1: from above), else 0. log|r − 1.3| grows too slowly
    for the bracket's 100× test: w is monotone over 1e-2 … 1e-11 (relative) from the edge,
    and its steps there do not shrink."""
    np = arb.np
    r = edge + side * np.array([1e-2, 1e-5, 1e-8, 1e-11]) * max(1.0, abs(edge))
    with np.errstate(all="ignore"):
        w = arb.w(r, arb.mu[row, 0], (arb.sign * arb.mag)[row, 0])
        step = np.diff(w)
    if np.isfinite(w).all() and (np.all(step > 0) or np.all(step < 0)) \
            and np.all(np.abs(step[1:]) >= 0.5 * np.abs(step[:-1])):
        return int(np.sign(step[0]))
    return 0


def _edge_growth(arb, e):
    """Per jump: +1 (or −1) where the bisection closed on its bracket's upper (lower) grid
    point and w ends just past it (the next grid point is undefined or the row ends) with |w|
    there over 100 times its value at the other grid point and the row's scale: growth
    toward an undefined edge (log(1 − π) as π → 1), which a grid cannot tell from a jump."""
    np = arb.np
    rows, j = e["row"], e["j"]
    out = np.zeros(rows.size, dtype=int)
    n = arb.R.shape[1]
    for side, at, other, past in ((1, j + 1, j, j + 2), (-1, j, j + 1, j - 1)):
        closed = (e["hi"] if side > 0 else e["lo"]) == arb.R[rows, at]
        past_ok = (past >= 0) & (past < n)
        ends = ~past_ok | ~arb.valid[rows, np.clip(past, 0, n - 1)]
        big = np.abs(arb.W[rows, at]) > 100 * np.fmax(np.abs(arb.W[rows, other]), arb.row_scale[rows, 0])
        out = np.where((out == 0) & closed & ends & big, side, out)
    return out


def _merge(arb, found):
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
                or _one_zero(arb, out[-1], ev)):
            row, lo, _, wl, _, early, gl, _ = out.pop()
            out.append((row, lo, ev[2], wl, ev[4], max(early, ev[5]), gl, ev[7]))
        else:
            out.append(ev)
    return out


def _shrank(arb, row, wl, wh, early) -> bool:
    """A sign change located to a double's resolution is continuous where |w| on both sides
    is small against the row's scale, or 1,000 times smaller than 40 halvings before: a
    steep crossing (slope −1100 where the row's median |w| is 1e-40) shrinks with its
    bracket, a jump across 0 does not."""
    top = max(abs(wl), abs(wh))
    return top <= 1e-6 * float(arb.row_scale[row, 0]) or top <= 1e-3 * early


def _continuous(arb, ev) -> bool:
    row, _, _, wl, wh, early, gl, gh = ev
    return 2 not in (gl, gh) and math.isfinite(wl) and math.isfinite(wh) and _shrank(arb, row, wl, wh, early)


def _one_zero(arb, a, b) -> bool:
    """a and b (consecutive on a row) are rounding around one zero: both continuous, close,
    and w in extended precision differs in state from w in doubles somewhere between them
    while it is nowhere 0 on two neighbouring samples (that would be a real interval of 0)."""
    np = arb.np
    if not (_continuous(arb, a) and _continuous(arb, b)) or b[1] - a[2] > CLUSTER * max(1.0, b[1]):
        return False
    lo, hi = a[1], b[2]
    pad = max(hi - lo, 1e-12 * hi)
    r = np.linspace(max(lo - pad, lo / 2), hi + pad, 65)
    mu, A = arb.mu[a[0], 0], (arb.sign * arb.mag)[a[0], 0]
    s64, sx = state(arb.w(r, mu, A)), state(arb.w(r, mu, A, dtype=np.longdouble))
    zero_run = np.any((sx[1:] == 0) & (sx[:-1] == 0))
    return bool(np.any(s64 != sx)) and 2 not in sx and not zero_run


def boundary_at(arb, g, events):
    """The events that a candidate boundary g(r, μ, A) = 0 accounts for: g changes sign
    (or is 0) across the event's bracket, widened by 1e-7 relative."""
    np = arb.np
    if not events:
        return np.zeros(0, dtype=bool)
    lo, hi = (np.array([e[k] for e in events]) for k in ("lo", "hi"))
    # widened by 1e-7 relative, but never past r = 1: at μ = 1e-12 the boundary r = 1 + μ
    # lies 1e-12 from the seam r = 1, which must not account for it. And by the rounding of
    # log π − log μ (2 ulps of |log μ|, 1e-14 at μ = 1e-12, 16 times over): a zero at r = 1
    # that the doubles place a few 1e-15 off is that zero, not a numeric finding of its own
    mu, A = np.array([e["mu"] for e in events]), np.array([e["A"] for e in events])
    h = np.maximum(1e-7 * np.minimum(hi, np.abs((lo + hi) / 2 - 1)), 4 * np.spacing(hi))
    h = np.maximum(h, 32 * np.finfo(float).eps * np.maximum(1, np.abs(np.log(mu))) * hi)
    lo, hi = lo - h, hi + h
    with np.errstate(all="ignore"):
        gl, gh = np.broadcast_to(g(lo, mu, A), lo.shape), np.broadcast_to(g(hi, mu, A), lo.shape)
    return (np.sign(gl) != np.sign(gh)) & np.isfinite(gl) & np.isfinite(gh) | (gl == 0) | (gh == 0)


def changes_sign_at(arb, r, mu, A, relative=False):
    """Outside the domain too: does w change state across r (1e-7 of max(r, 1), or of r
    itself where relative, for r far below 1)? Returns that,
    where w is defined on both sides at all (ℓ may overflow a double out there), and each
    point's kind, from probing it: w = 0 on the side away from r = 1 ("w = 0 beyond") or
    toward it ("w = 0 before"), else a sign change, continuous or not."""
    np = arb.np
    h = 1e-7 * (r if relative else np.maximum(r, 1.0))
    with np.errstate(invalid="ignore"):         # a candidate's r*(μ, A) may be inf or nan there
        s = state(arb.w(r - h, mu, A)), state(arb.w(r + h, mu, A))
        defined = (s[0] != 2) & (s[1] != 2) & np.isfinite(r) & (r - h > 0)
    changed = (s[0] != s[1]) & defined
    # labelled where it changes only (four more evaluations each; "" elsewhere)
    kind = np.full(np.shape(changed), "", dtype=object)
    if changed.any():
        pick = (lambda x: np.broadcast_to(x, np.shape(changed))[changed])
        kind[changed] = kind_at(arb, pick(r), pick(mu), pick(A), (pick(s[0]), pick(s[1])))
    return changed, defined, kind


def undefined_at(arb, r, mu, A):
    """Where ℓ is NaN on both sides of r (relative 1e-7) even in extended precision: a log or
    an even root of a negative number, 0/0, ∞ − ∞, where a zero of the derived w is no place
    of w at all; an overflow (ℓ = ±inf in doubles, a number in long double) is not."""
    np = arb.np
    h = 1e-7 * np.maximum(r, 1.0)
    out = np.ones(np.shape(r), dtype=bool)
    with np.errstate(all="ignore"):
        for x in (r - h, r + h):
            x, m, a = np.broadcast_arrays(*(np.asarray(v, dtype=np.longdouble) for v in (x, mu, A)))
            ell = numpy_plan(arb.obj.expr)({"r": x, "mu": m, "pi": m * x, "A": a, **arb.params})[0]
            out &= np.isnan(np.broadcast_to(ell, x.shape))
    return out


def kind_at(arb, r, mu, A, states):
    """The label of a sign change at r from w on both sides: |w| 1e-9 away against |w| 1e-3
    away tells a continuous crossing (w → 0 at r) from a jump across 0."""
    np = arb.np
    sl, sh = states
    # at r = 1 itself (a boundary 1/μ at μ = 1) the side of r > 1 is the one away from it
    inner, outer = np.where(r >= 1, sl, sh), np.where(r >= 1, sh, sl)
    with np.errstate(all="ignore"):
        near = np.fmax(*(np.abs(arb.w(r * (1 + d), mu, A)) for d in (-1e-9, 1e-9)))
        far = np.fmax(*(np.abs(arb.w(r * (1 + d), mu, A)) for d in (-1e-3, 1e-3)))
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
