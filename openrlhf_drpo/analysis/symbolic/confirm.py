"""Where the symbolic derivation and the numeric arbiter meet: each symbolic claim (the
weight, the boundaries and their reachability, the range, continuity) is checked against
what the arbiter found with the IR's float rules. A confirmed claim is printed as derived;
one the arbiter contradicts is replaced by the numeric finding and flagged."""
from __future__ import annotations

from openrlhf_drpo.analysis.numeric.arbiter import DENSE_MAGNITUDES, MAGNITUDES, SIGNS
from openrlhf_drpo.analysis.numeric.arbiter import state
from openrlhf_drpo.analysis.numeric.events import (bisect_change, boundary_at, changes_sign_at, describe, kind_at,
                                                   rounded, undefined_at)
from openrlhf_drpo.analysis.mathtext import fmt, math_text


def _probe_mus():
    import numpy as np
    return np.unique(np.concatenate([np.logspace(-6, 0, 2000), np.linspace(1e-3, 1, 2000)]))


PROBE_MUS = _probe_mus()


# two grid places at most this far apart (relative) are one threshold's two sides (the arbiter puts
# them SIDE = 1e-6 either way of it)
TWO_SIDES = 4e-6


def check_weight(arb, w_symbolic) -> dict:
    """The derived weight against the IR's own derivative at every grid point where both are
    defined, except next to a jump, where the two may round a threshold differently, and on a
    threshold itself, between the two sides the rows hold of it: at r = 1.5, |π − μ| ≤ 0.5·μ reads
    π = 1.5·μ in doubles and may fail where the derived |r − 1| ≤ 0.5 holds."""
    np = arb.np
    R = arb.R
    with np.errstate(all="ignore"):
        ws = np.asarray(w_symbolic(R, arb.mu, arb.sign * arb.mag), dtype=float)
        ws = np.broadcast_to(ws, R.shape)
        on = np.zeros(R.shape, dtype=bool)
        on[:, 1:-1] = R[:, 2:] <= R[:, :-2] * (1 + TWO_SIDES)
        both = arb.valid & ~arb.near_event & ~on
        bad = both & ~(np.abs(ws - arb.W) <= 1e-6 * np.maximum(1.0, np.abs(arb.W)))
    checked = int(both.sum())
    if not checked:
        return {"status": "unconfirmed", "points": 0}
    if not bad.any():
        return {"status": "confirmed", "points": checked}
    i, j = (int(x[0]) for x in np.nonzero(bad))
    mu, r = float(arb.mu[i, 0]), float(arb.R[i, j])
    return {"status": "disagrees", "points": checked, "bad_points": int(bad.sum()),
            "example": {"mu": mu, "pi": mu * r, "A": float(arb.sign[i, 0] * arb.mag[i, 0]),
                        "derived": float(ws[i, j]), "numeric": float(arb.W[i, j])}}


def settle_zero_weight(ctx, arb, facts, tail_facts, cases, check) -> None:
    """Per sign of A where every derived piece of w is 0 (SymPy: r/group_mean(r) − 1 on a uniform
    group) and the arbiter confirms it, the grid's sign changes, touches and jumps are the doubles'
    rounding of that 0 (±1 ulp), not events of w, and w tends to 0 at both tails; where both signs
    are 0, so is the range. A note gives the size of the rounding."""
    np = arb.np
    if check["status"] != "confirmed":
        return
    zero = [adv for adv, _ in SIGNS
            if all(e == 0 for c in cases if c["advantage"] == adv for e, _ in c["_pieces"])]
    for adv in zero:
        f = facts[adv]
        f["rounding"] += f["events"] + f["touches"] + f["jumps"]
        f["events"], f["touches"], f["jumps"] = [], [], []
        tails = tail_facts["by_sign"][adv]
        for side in ("zero", "infinity"):
            if tails[side]["kind"] != "is 0 (cut off)":     # exact zeros in doubles already say so
                tails[side] = {"kind": "is 0", "sign": None, "note": None}
        side = arb.valid & ((arb.sign > 0) == (adv == "positive"))
        top = float(np.max(np.abs(arb.W[side]), initial=0.0))
        if top > 0:
            ctx.note(f"for A {'>' if adv == 'positive' else '<'} 0, w = 0 (derived), and the doubles give it as "
                     f"|w| ≤ {top:.3g} (rounding): no sign change, touch or jump of w")
    if zero:
        facts["continuous"] = not any(facts[adv][k] for adv, _ in SIGNS for k in ("jumps", "poles")) and not any(
            e["kind"] == "jumps across 0" or e["kind"].startswith("w = 0") for adv, _ in SIGNS for e in facts[adv]["events"])
    if len(zero) == len(SIGNS) and facts["range"] is not None:
        facts["range"] = [0.0, 0.0]


def confirm_boundaries(ctx, arb, facts, candidates) -> tuple[dict, list]:
    """candidates[adv]: [(r_expr, pi_expr(), g, explicit)] from the symbolic path, where g(r, μ, A)
    is 0 on the candidate. A candidate is a boundary if the arbiter finds w changing sign (or
    entering an interval of 0) on it; a closed-form one it never meets inside the domain is
    probed outside (π > 1 or μ → 0): a sign change there makes it an unreachable boundary,
    none makes it no boundary at all. Sign changes no candidate accounts for are reported
    as the numeric finding."""
    np, sp = arb.np, ctx.sp
    boundary, notes = {}, []
    for adv, sign in SIGNS:
        events = facts[adv]["events"] + _threshold_events(arb, sign)
        used = np.zeros(len(events), dtype=bool)
        # where w depends on |A|: its sign changes between the |A| the rows sample (_between_magnitudes),
        # searched only where something asks (a candidate no row meets, a change none accounts for)
        scan, between = {}, len(arb.magnitudes) > 1
        out = {"r": [], "pi": [], "kind": [], "reachable": [], "numeric": [], "where": []}
        for r_expr, pi_expr, g, explicit, edge in candidates[adv]:
            if any(_same_place(r_expr, x) for x in out["r"]):
                continue
            hit, before = boundary_at(arb, g, events), used.copy()
            if r_expr == 1:
                # the seam takes no event another candidate places: an edge 1 + 0.1·μ lies 1.3e-13 from
                # r = 1 at μ = 1.3e-12, inside the seam's allowance for rounding, and is no seam's
                for _, _, other, _, _ in candidates[adv][1:]:
                    hit &= ~boundary_at(arb, other, events)
            where = ""
            if hit.any():
                kinds = sorted({events[i]["kind"] for i in np.nonzero(hit)[0]})
                # the located points, for the geometry (and the |A| it holds at, where that is not all)
                where = _place(arb, [events[i] for i in np.nonzero(hit)[0]], explicit)
                used |= hit
                reachable = True
            elif edge:
                # a piece's edge below the grid's r (a band's lower edge at r = 1e-20): w's
                # change there, probed along it; none is no place at all
                kinds = _edge_below_grid(arb, explicit, sign)
                if not kinds:
                    continue
                reachable = True
            elif explicit is not None:
                # a zero the grid's rows did not meet: probed on its own curve r*(μ) at many μ,
                # since it may be a boundary only in a narrow band of μ, or only outside the domain,
                # and at every |A| and μ the arbiter sampled (either side of the objective's own
                # thresholds on them: the region a candidate's conditions allow)
                mags = np.unique(np.concatenate([MAGNITUDES, arb.magnitudes] +
                                                [DENSE_MAGNITUDES] * (len(arb.magnitudes) > 1)))
                mus = np.unique(np.concatenate([PROBE_MUS, arb.mu[:, 0]]))
                A = np.repeat(sign * mags, mus.size)
                mu = np.tile(mus, mags.size)
                with np.errstate(all="ignore"):
                    r_star = np.broadcast_to(np.asarray(explicit(mu, A), dtype=float), mu.shape)
                changed, defined, kind = changes_sign_at(arb, r_star, mu, A)
                if changed.any():
                    kinds = sorted(set(kind[changed]))     # each label from probing the boundary itself
                    # met inside the domain: with its far side too (1/μ is π = 1, the domain's edge)
                    reachable = bool((changed & (mu * (r_star + 1e-7 * np.maximum(r_star, 1.0)) <= 1)).any())
                elif (r_star > 0).any() and not defined[r_star > 0].any() and \
                        not undefined_at(arb, r_star[r_star > 0], mu[r_star > 0], A[r_star > 0]).all():
                    kinds, reachable = ["unconfirmed"], False    # ℓ overflows a double there: kept, flagged
                else:
                    touches = boundary_at(arb, g, [{**t, "lo": t["r"], "hi": t["r"]} for t in facts[adv]["touches"]])
                    why = ("lies at r ≤ 0 for every 0 < μ ≤ 1" if not (r_star > 0).any() else
                           "lies where ℓ is undefined (not a number even in extended precision: a log or root "
                           "of a negative number, 0/0)" if not defined[r_star > 0].any() else
                           "is where w touches 0 without changing sign" if touches.any() else
                           "is not a sign change of w (checked numerically)")
                    note = (f"the symbolic zero r = {math_text(r_expr)} for A {'>' if sign > 0 else '<'} 0 {why}: "
                            "not a boundary")
                    if note not in notes:
                        notes.append(note)
                    continue
            elif between and isinstance(r_expr, sp.Eq) and \
                    (hit := boundary_at(arb, g, (dense := _scan(scan, arb, sign))["events"])).any():
                # an implicit zero met between the |A| the rows sample only (1 + (r − 2.5)⁵/A = 0 lies
                # in the unclipped piece r < 0.72 for 18 < |A| < 98 only)
                kinds = sorted({dense["events"][i]["kind"] for i in np.nonzero(hit)[0]})
                where = _place(arb, [dense["events"][i] for i in np.nonzero(hit)[0]], explicit)
                dense["used"] |= hit
                reachable = True
            else:
                continue        # an edge where w might have jumped, and does not
            pi = pi_expr()
            if isinstance(pi, sp.logic.boolalg.BooleanAtom):
                # SymPy decides h(π/μ) = 0 has no solution: no boundary, whatever the doubles did there
                used = before
                continue
            for key, v in (("r", r_expr), ("pi", pi), ("kind", ", ".join(kinds)), ("reachable", reachable),
                           ("where", where)):
                out[key].append(v)
        rest = [e for e, u in zip(events, used) if not u]
        # between the |A| sampled, a change a candidate accounts for, or at a place one accounts for on the
        # grid's rows (a flat zero r = 2.5 that an expanded (r − 2.5)⁵ cannot bracket in doubles)
        placed, across = [e for e, u in zip(events, used) if u], set()
        if between and (rest or scan or not candidates[adv]):
            dense = _scan(scan, arb, sign)
            taken = dense["used"] | _accounted(arb, dense["events"], candidates[adv])
            rest += [e for e, hit in zip(dense["events"], taken) if not hit and not any(
                p["mu"] == e["mu"] and abs(p["r"] - e["r"]) <= 1e-6 * max(1.0, p["r"]) for p in placed)]
            across = dense["across"]
        for kind in sorted({e["kind"] for e in rest}):
            # r > 1, r < 1: separate boundaries, unless w at r = 1 changes sign as |A| varies (a
            # zero that moves through r = 1 with |A|: one span, else the r between is in neither)
            for side in ((None,) if kind in across else (True, False)):
                group = [e for e in rest if e["kind"] == kind and side in (None, e["r"] > 1)]
                if group:
                    out["numeric"].append({"where": _place(arb, group), "kind": kind})
        boundary[adv] = out
    return boundary, notes


def _scan(scan: dict, arb, sign) -> dict:
    """_between_magnitudes' events (and which of them a candidate took, 'used'), found once per sign."""
    if not scan:
        events, across = _between_magnitudes(arb, sign)
        scan.update(events=events, across=across, used=arb.np.zeros(len(events), dtype=bool))
    return scan


def _accounted(arb, events, candidates):
    """Which events a candidate accounts for (boundary_at); a zero leaving through r → 0 between two
    |A| (an event with 'before', the |A| it was inside at), where g changes sign at that r between them."""
    np = arb.np
    hit = np.zeros(len(events), dtype=bool)
    exits = [i for i, e in enumerate(events) if "before" in e]
    for _, _, g, _, _ in candidates:
        hit |= boundary_at(arb, g, events)
        for i in exits:
            e = events[i]
            with np.errstate(all="ignore"):
                a, b = (float(np.asarray(g(e["r"], e["mu"], x), dtype=float)) for x in (e["before"], e["A"]))
            hit[i] |= bool(np.isfinite(a) and np.isfinite(b) and (a == 0 or b == 0 or np.sign(a) != np.sign(b)))
    return hit


def _between_magnitudes(arb, sign) -> tuple[list, set]:
    """Where w depends on |A| and the grid's rows show a sign change it found no formula for: the
    same rows (their μ and r) at every quarter decade of |A| between the arbiter's, each change
    located and labelled as the grid's are, so that a span that moves with |A| is not cut short
    at the |A| sampled (r from 0.29 to 0.86 at |A| = 1, where at |A| = 1.9 it lies at 0.95). Where
    the row's first point changes sign between two of them, a zero left through r → 0: that point
    is an event too. A change that extended precision shows to be the doubles' rounding is none
    (events.rounded). Returns those events and the kinds whose zero moves through r = 1 (w there
    changes sign between two |A|)."""
    np = arb.np
    rows = np.flatnonzero((arb.sign[:, 0] == sign) & (arb.mag[:, 0] == arb.magnitudes[0]))
    lo_mag, hi_mag = min(arb.magnitudes), max(arb.magnitudes)
    mags = np.unique(np.concatenate([[m for m in DENSE_MAGNITUDES if lo_mag <= m <= hi_mag], arb.magnitudes]))
    R = np.tile(arb.R[rows], (mags.size, 1))
    mu = np.tile(arb.mu[rows], (mags.size, 1))
    A = sign * np.repeat(mags, rows.size)[:, None]
    with np.errstate(all="ignore"):
        W = arb.w(R, mu, A)
        at_one = state(arb.w(np.ones_like(mu), mu, A)).reshape(mags.size, rows.size)
    S = state(W)
    out = []
    # a sign change between neighbours, or across one grid point where w is exactly 0 (an interval
    # of 0 and its edges are |A|-fixed thresholds the grid's rows see: not searched here)
    i, j = np.nonzero(S[:, 1:] * S[:, :-1] == -1)
    i2, j2 = np.nonzero((S[:, 2:] * S[:, :-2] == -1) & (S[:, 1:-1] == 0))
    i, j, k = np.concatenate([i, i2]), np.concatenate([j, j2]), np.concatenate([j + 1, j2 + 2])
    if i.size:
        lo, hi = bisect_change(arb, R[i, j], R[i, k], mu[i, 0], A[i, 0])
        real = ~np.array(rounded(arb, lo, hi, mu[i, 0], A[i, 0]), dtype=bool)
        i, j, k, lo, hi = i[real], j[real], k[real], lo[real], hi[real]
        r = (lo + hi) / 2
        labels = kind_at(arb, r, mu[i, 0], A[i, 0], (S[i, j], S[i, k]))
        out += [{"mu": float(m), "A": float(a), "r": float(x), "kind": str(k_), "lo": float(a_), "hi": float(b_)}
                for m, a, x, k_, a_, b_ in zip(mu[i, 0], A[i, 0], r, labels, lo, hi)]
    first = S[:, 0].reshape(mags.size, rows.size)
    exits = (first[1:] * first[:-1] == -1)
    for k, c in zip(*np.nonzero(exits)):
        if _leaves_through_zero(arb, arb.R[rows[c]], float(arb.mu[rows[c], 0]), sign * mags[k], sign * mags[k + 1]):
            x = float(arb.R[rows[c], 0])
            out.append({"mu": float(arb.mu[rows[c], 0]), "A": float(sign * mags[k + 1]), "r": x, "kind": "crosses 0",
                        "lo": x, "hi": x, "before": float(sign * mags[k])})
    moves = bool(np.any((at_one[1:] != at_one[:-1]) & (np.abs(at_one[1:]) == 1) & (np.abs(at_one[:-1]) == 1)))
    return out, ({"crosses 0"} if moves else set())


def _leaves_through_zero(arb, row, mu, a, b) -> bool:
    """Whether w's state at the row's first point changes between A = a and b because a zero moves
    through it: at the |A| where it changes (bisected), the row's first sign change is next to
    that point. (Where w on r < 1 changes sign as a whole, 1 − 0.05·μ/|A|, the change is at r = 1.)"""
    np = arb.np
    s0 = state(arb.w(row[0], mu, a))
    for _ in range(60):
        m = np.copysign(np.sqrt(a * b), a)      # a and b share A's sign
        a, b = (m, b) if state(arb.w(row[0], mu, m)) == s0 else (a, m)
    with np.errstate(all="ignore"):
        s = state(arb.w(row[~np.isnan(row)], mu, a))
    changed = np.flatnonzero((s != s0) & (s != 2))
    return bool(changed.size) and changed[0] <= 2


def _threshold_events(arb, sign) -> list:
    """Sign changes of w across the objective's own thresholds in r at the quarter decades of |A|
    the rows do not sample, where w depends on |A|: with a penalty not scaled by |A|, w jumps across
    0 at a clip's edge r = 0.72 only for 1.5 < |A| < 5.5, between the rows' |A| = 1 and 1000. Each
    row's own thresholds too (the two sides of each that the grid's rows hold): an edge that moves
    with μ, r = 1 + 0.1·μ, or one in π, |π − μ| ≤ 0.5·μ. Each as an event of the grid's."""
    np = arb.np
    if len(arb.magnitudes) <= 1:
        return []
    rows = arb.sign[:, 0] == sign
    R, mus = arb.R[rows], np.broadcast_to(arb.mu[rows], arb.R[rows].shape)
    pair = (R[:, 1:] <= R[:, :-1] * (1 + TWO_SIDES)) & np.isfinite(R[:, 1:])
    found = np.unique(np.stack([mus[:, :-1][pair], R[:, :-1][pair], R[:, 1:][pair]], axis=1), axis=0)
    mags = np.array([m for m in DENSE_MAGNITUDES if m not in arb.magnitudes])
    if not found.size or not mags.size:
        return []
    mu, a, b = (np.tile(found[:, k], mags.size) for k in range(3))
    mag = np.repeat(mags, len(found))
    with np.errstate(all="ignore"):
        s = [state(arb.w(x_, mu, sign * mag)) for x_ in (a, b)]
    hit = (s[0] != s[1]) & (s[0] != 2) & (s[1] != 2)
    if not hit.any():
        return []
    r = (a[hit] + b[hit]) / 2
    kinds = kind_at(arb, r, mu[hit], sign * mag[hit], (s[0][hit], s[1][hit]))
    return [{"mu": float(m), "A": float(sign * g), "r": float(x_), "kind": str(k), "lo": float(lo), "hi": float(hi)}
            for m, g, x_, k, lo, hi in zip(mu[hit], mag[hit], r, kinds, a[hit], b[hit])]


def _place(arb, group, explicit=None) -> str:
    """Where a boundary lies (events.describe of the points located on it), and where w depends
    on |A| and the grid met it at some of the |A| sampled only, at which |A| it holds: w probed
    across the same points (or the derived r*(μ, A), `explicit`) at every quarter decade of |A|
    and the arbiter's, the run of them around those met. A clip's edge r = 2.5 that is a sign
    change only for |A| ≳ 7.5 (w ≈ −0.2 on both sides below) must not read as fixed for every |A|."""
    np = arb.np
    where, mags = describe(group), sorted({abs(e["A"]) for e in group})
    if len(arb.magnitudes) <= 1 or len(mags) == len(arb.magnitudes) or where.startswith("r from"):
        return where        # (a span of r already says that it moves with μ and |A|)
    probe = np.unique(np.concatenate([DENSE_MAGNITUDES, arb.magnitudes]))
    r, mu = (np.array([e[k] for e in group])[None, :] for k in ("r", "mu"))
    r, mu, A = np.broadcast_arrays(r, mu, np.sign(group[0]["A"]) * probe[:, None])
    if explicit is not None:
        with np.errstate(all="ignore"):
            r = np.broadcast_to(np.asarray(explicit(mu, A), dtype=float), mu.shape)
    changed = changes_sign_at(arb, r, mu, A, relative=True)[0].any(axis=1)
    if changed.all():
        return where
    changed |= np.isin(probe, mags)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], changed.astype(int), [0]])))
    runs = list(zip(edges[::2], edges[1::2] - 1))
    if len(runs) > 1:       # not one run: the |A| met, each
        span = "= " + ", ".join(fmt(m) for m in mags)
    else:
        lo, hi = runs[0]
        span = f"= {fmt(probe[lo])} only" if lo == hi else f"from {fmt(probe[lo])} to {fmt(probe[hi])}"
    return f"{where} at |A| {span} of those sampled (it depends on |A|)"


def _edge_below_grid(arb, explicit, sign) -> list:
    """The labels of w's sign changes on a piece's edge r*(μ, A) where it lies below the
    grid's smallest r (inside the domain, which the grid does not sample there), probed at
    r*·(1 ± 1e-7) at the arbiter's μ and |A|."""
    np = arb.np
    lowest = float(np.nanmin(arb.R))
    mags = np.asarray(arb.magnitudes, dtype=float)
    mus = np.unique(arb.mu[:, 0])
    A, mu = np.repeat(sign * mags, mus.size), np.tile(mus, mags.size)
    with np.errstate(all="ignore"):
        r_star = np.broadcast_to(np.asarray(explicit(mu, A), dtype=float), mu.shape)
    below = np.isfinite(r_star) & (r_star > 0) & (r_star < lowest)
    if not below.any():
        return []
    changed, _, kind = changes_sign_at(arb, r_star[below], mu[below], A[below], relative=True)
    return sorted(set(kind[changed]))


def _same_place(a, b) -> bool:
    """One candidate twice: the same r*, or implicit equations h = 0 and −h = 0."""
    if a == b:
        return True
    import sympy as sp
    if isinstance(a, sp.Eq) or isinstance(b, sp.Eq):
        return isinstance(a, sp.Eq) and isinstance(b, sp.Eq) and sp.expand(a.lhs - a.rhs + b.lhs - b.rhs) == 0
    # one place written two ways: a piece's edge 1 + (1 − μ)/μ and a zero 1/μ
    return a.free_symbols == b.free_symbols and sp.cancel(a - b) == 0


def compare_range(claim, numeric) -> tuple[list, bool]:
    """(the range to print, whether the claim held): sides agree when both are unbounded or
    both finite within 1e-3 relative (two grids, one of them snapped to exact values)."""
    if numeric is None:
        return claim, claim is None
    agree = all((c is None and n is None) or (c is not None and n is not None and
                                              abs(c - n) <= 1e-3 * max(1.0, abs(n)))
                for c, n in zip(claim or [None, None], numeric))
    if not agree:
        return numeric, False
    # agreeing sides: the more extreme of the two samples (the claim's are snapped to exact
    # corner values; the arbiter's include where w touches 0 between grid points)
    lo, hi = (None if c is None else f(c, n) for c, n, f in zip(claim, numeric, (min, max)))
    return [lo, hi], True
