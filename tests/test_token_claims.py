"""No confident wrong claim on token-level objectives (issue 45 item 4): each row is the smallest
objective that showed one, and the claim that must not be made about it (each failed on the code
before the fix). What the comments say of each weight is checked with the arbiter's own float
rules (Analysis.w_numeric: an oracle that shares the code under test, and says so); the random
check that found them, held to sympy.diff instead, is test_arbiter's (tests/random_claims.py at
scale)."""
import numpy as np
import pytest
from oracles import located

import dsl
from openrlhf_drpo.analysis import budgets
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report

# w = 1 − 0.05·μ·sign(r − 1)/A: on the row μ = 0.02, |A| = 1e-3, r < 1, w = 1 − 1 (the doubles' 0.02
# makes it −5.5e-17), which exp(log r)/r rounds to 0 or ±2e-16 by turns: no boundary at r ≈ 2.5e-4
EXP_LOG = "exp(log(r))*A - 0.05*|π - μ|"
# ℓ' ~ (r − 1.655)³: a flat odd-order zero, a sign change that long double's own rounding hides
# 1e-9 away from it, and that doubles and long double agree on 1e-7 away
FLAT3 = "sqrt(1 + log(1 + (r - sqrt(1 + log(1 + r^2)^2))^2)^2)"
FLAT3_AT = 1.6552810174027085
# for |A| ≥ 7, A > 0: w = [r < 2.5] − (r − 1)/(0.2·A): a jump across 0 at r = 2.5 only for A > 7.5 (below
# it w < 0 on both sides), and a crossing at r = 1 + A/5 only for 7 ≤ A < 7.5; for |A| < 7, w = 0
GATED_EDGE = "[|A| >= 7]*(min(r*A, clip(r, 0.9, 2.5)*A) - (r - 1)^2/0.4)"
# for A < 0 at r = 0.72: w = 3·log(r)/r + 4(r − 2.5)³/((1 + (r − 2.5)⁴)·A) below the clip's edge, 1 more
# above: −1.37 + 2.04/|A| against −0.37 + 2.04/|A|, a jump across 0 only for 1.5 < |A| < 5.5, between
# the rows' |A| = 1 and 1000 (found by the random check, seed 3)
BETWEEN_ROWS = "min(r*A, clip(r, 0.72, 1.28)*A) - |A|*1.5*log(r)^2 + log(1 + (r - 2.5)^4)"
# for A > 0 at the edge r = 1 + 0.1·μ (1.05 at μ = 0.5): w = 2 + 4(r − 2.5)³/((1 + (r − 2.5)⁴)·A) below it,
# 1 less above: 2 − 2.25/A against 1 − 2.25/A, a jump across 0 only for 1.125 < A < 2.25, at an edge that
# moves with μ (found by the random check, token strategy: the |A| between the rows probed fixed edges only)
MOVING_EDGE = "log(1 + (r - 2.5)^4) + r*A + min(r*A, clip(r, 0.9, 1 + 0.1*μ)*A)"
# for A > 0, w = 1 up to the edge r = 1 + 0.1·μ and 0 past it: one boundary, which tends to r = 1 as μ → 0;
# at the grid's μ = 1.3e-12 it lies 1.3e-13 from r = 1, and the seam r = 1 took it as a boundary of its own
EDGE_LIMIT = "min(r*A, clip(r, 0.9, 1 + 0.1*μ)*A)"
# for A > 0 at the band's edge r = 1.5 (|π − μ| = 0.5·μ): w = 2 − (r − 1)/(0.2·A) inside, 1 − (r − 1)/(0.2·A)
# past it: 2 − 2.5/A against 1 − 2.5/A, a jump across 0 only for 1.25 < A < 2.5 (a Hypothesis example)
BAND_EDGE = "[|π - μ| <= 0.5*μ]*r*A + r*A - (r - 1)^2/(2*0.2)"
# the same, with A·(r − 1) ≤ 0 in the condition: |π − μ| = 0.5·μ at the grid's r = 0.5 and A·(r − 1) = 0
# at r = 1 each changed state on both sides of a grid point, and the four twice-found places took the
# row's four threshold columns: r = 1.5 had none
CROWDED_BAND_EDGE = "[A*(r - 1) <= 0 or |π - μ| <= 0.5*μ]*r*A + r*A - (r - 1)^2/(2*0.2)"

# for A > 0 and r > 1: w = −5·μ + 6(r − 2.5)³/(1 + (r − 2.5)⁴), least toward the corner π = 1, μ → 1:
# −5 − 3.3402 = −8.3402; the grid's eight lowest points were all the side r → 0.8⁻ of a jump at μ = 1 for
# A < 0 (−8.152), and the range stopped there (found by tests/random_claims.py, token strategy, seed 8)
CORNER_EXTREME = "-|A|*|π - μ|/0.2 + max(min(r*A, clip(r, 0.8, 1.2)*A), 3*A) + 1.5*log(1 + (r - 2.5)^4)*A"
CORNER_INF = -5 + 6 * (-1.5) ** 3 / (1 + 1.5 ** 4)
# the same class at the top: w = 1 + 20μ for A < 0 just above r = 1 (r ≤ 1/μ), → 21 as μ → 1; the grid's
# rows gave at most 20 (found by tests/random_claims.py, token strategy, seed 21, before ca034da)
TOP_CORNER = "max(min(r*A, clip(r, 1 - 0.28, 1 + 0.28)*A), 2*A) - 2*|A|*|π - μ|/0.1"


def _places(res, side):
    b = res.boundary[side]
    return list(b["where"]) + [x["where"] for x in b["numeric"]]


def _at(res, side, r, mu=0.5):
    return any(w and located(w, r, mu) for w in _places(res, side))


WRONG_CLAIMS = [
    # (objective, the claim that must not be made, whether it is made)
    (EXP_LOG, "a boundary for A < 0 at the rounding of exp(log r) at tiny r",
     lambda res: bool(res.boundary["negative"]["numeric"])),
    (FLAT3, "no boundary for A > 0 at a third-order zero", lambda res: not _at(res, "positive", FLAT3_AT)),
    (FLAT3, "no boundary for A < 0 at a third-order zero", lambda res: not _at(res, "negative", FLAT3_AT)),
    (GATED_EDGE, "a boundary met at some |A| only, given as if it held at every |A|",
     lambda res: any(" at |A| " not in w for w in res.boundary["positive"]["where"])),
    (BETWEEN_ROWS, "no boundary for A < 0 at the clip's edge r = 0.72, where w jumps across 0 for 1.5 < |A| < 5.5",
     lambda res: not any(located(w, 0.72, 0.5, -3.0) for w in _places(res, "negative") if w)),
    (MOVING_EDGE, "no boundary for A > 0 at the edge r = 1 + 0.1·μ, where w jumps across 0 for 1.125 < A < 2.25",
     lambda res: not any(located(w, 1.05, 0.5, 1.9) for w in _places(res, "positive") if w)),
    (EDGE_LIMIT, "a boundary r = 1 for A > 0: the edge r = 1 + 0.1·μ's limit as μ → 0",
     lambda res: any(x == 1 for x in res.boundary["positive"]["r"])),
    (MOVING_EDGE, "a boundary r = 1 for A > 0: the edge r = 1 + 0.1·μ's limit as μ → 0",
     lambda res: any(x == 1 for x in res.boundary["positive"]["r"])),
    (BAND_EDGE, "no boundary for A > 0 at the band's edge r = 1.5, where w jumps across 0 for 1.25 < A < 2.5",
     lambda res: not any(located(w, 1.5, 0.5, 1.9) for w in _places(res, "positive") if w)),
    (BAND_EDGE, "the derived weight said to disagree with the arbiter, where the doubles round π = 1.5·μ at "
     "the band's edge r = 1.5 (the IR's |π − μ| ≤ 0.5·μ fails there, the derived |r − 1| ≤ 0.5 holds)",
     lambda res: res.arbiter["weight"]["status"] != "confirmed"),
    (CROWDED_BAND_EDGE, "no boundary for A > 0 at r = 1.5, its threshold crowded out of the rows by r = 0.5 and 1",
     lambda res: not any(located(w, 1.5, 0.5, 1.9) for w in _places(res, "positive") if w)),
    (CORNER_EXTREME, "a lowest w of −8.152, where w → −8.340 toward π = 1 as μ → 1 for A > 0",
     lambda res: res.weight_range[0] is not None and res.weight_range[0] > CORNER_INF + 1e-4),
    (TOP_CORNER, "a highest w of 20, where w → 21 toward π = 1 as μ → 1 for A < 0",
     lambda res: res.weight_range[1] is not None and res.weight_range[1] < 21 - 1e-4),
    (GATED_EDGE, "the first screen without the |A| the edge r = 2.5 holds at",
     lambda res: "(r = 2.5), at |A| from 10 to 1000 of those sampled" not in " ".join(report(res).split())),
]


@pytest.mark.parametrize("text, claim, made", WRONG_CLAIMS, ids=[f"{t[:24]}: {c}" for t, c, _ in WRONG_CLAIMS])
def test_the_report_makes_no_wrong_claim_about_the_smallest_token_level_objective_that_showed_it(text, claim, made):
    res = analyze(dsl.parse(text))
    assert not made(res), f"{claim}:\n{report(res)}"


def test_the_weights_the_rows_rest_on_are_what_their_comments_say_by_the_arbiters_own_rules():
    w = analyze(dsl.parse(EXP_LOG)).w_numeric
    r = np.geomspace(1e-6, 0.9, 200)
    assert np.all(np.abs(w(r, 0.02, -1e-3)) <= 2e-15)           # 0 but for rounding, of either sign
    assert np.all(np.abs(w(r.astype(np.longdouble), 0.02, -1e-3, dtype=np.longdouble) + 5.55e-17) < 1e-18)
    gated = analyze(dsl.parse(GATED_EDGE)).w_numeric
    around = np.array([2.5 * (1 - 1e-9), 2.5 * (1 + 1e-9)])
    assert gated(around, 0.3, 7.2).max() < 0 and gated(around, 0.3, 7.6)[0] > 0 > gated(around, 0.3, 7.6)[1]
    assert np.all(gated(np.geomspace(1e-3, 3, 50), 0.3, 6.9) == 0)
    between = analyze(dsl.parse(BETWEEN_ROWS)).w_numeric
    around = np.array([0.72 * (1 - 1e-9), 0.72 * (1 + 1e-9)])
    for mag, signs in ((1.0, (1, 1)), (1.6, (-1, 1)), (5.4, (-1, 1)), (5.6, (-1, -1)), (1000.0, (-1, -1))):
        assert tuple(np.sign(between(around, 0.5, -mag))) == signs, mag
    corner = analyze(dsl.parse(CORNER_EXTREME)).w_numeric
    assert corner(1 / (1 - 1e-9), 1 - 1e-9, 1.0) == pytest.approx(CORNER_INF, abs=1e-6) and CORNER_INF < -8.34
    assert corner(0.8 * (1 - 1e-9), 1.0, -1.0) == pytest.approx(-5 + 6 * (-1.7) ** 3 / (1 + 1.7 ** 4), abs=1e-6)
    top = analyze(dsl.parse(TOP_CORNER)).w_numeric
    assert top(1 / (1 - 1e-9), 1 - 1e-9, -1.0) == pytest.approx(21, abs=1e-6)
    limit = analyze(dsl.parse(EDGE_LIMIT)).w_numeric
    for mu in (0.5, 1e-6, 1.3e-12):      # w = 1, then 0, at the edge only: at r = 1 it is 1 on both sides
        edge = 1 + 0.1 * mu
        assert limit(np.array([1 - mu, 1 + mu / 20, edge * (1 - 1e-15), edge * (1 + 1e-14)]), mu, 2.0).tolist() == [1, 1, 1, 0]
    for text, edge in ((MOVING_EDGE, 1.05), (BAND_EDGE, 1.5), (CROWDED_BAND_EDGE, 1.5)):
        moving = analyze(dsl.parse(text)).w_numeric
        around = np.array([edge * (1 - 1e-9), edge * (1 + 1e-9)])
        top = 2.25 if text == MOVING_EDGE else 2.5
        for mag, signs in ((1.0, (-1, -1)), (top / 2 + 0.05, (1, -1)), (top - 0.05, (1, -1)), (top + 0.05, (1, 1))):
            assert tuple(np.sign(moving(around, 0.5, mag))) == signs, (text, mag)
    flat = analyze(dsl.parse(FLAT3)).w_numeric
    for h in (1e-3, 1e-5, 1e-7):
        lo, hi = flat(np.array([FLAT3_AT - h, FLAT3_AT + h]), 0.5, 1.0)
        assert lo < 0 < hi and abs(lo) < 0.05 * h ** 3 * 1.2


# w = (r − 1.655)³/A + 0.1·(r − 0.5)³ − sign(A)·(r − 1)/0.28: its zeros move with |A| (at |A| = 1, 0.29 and
# 0.86; at 1.91, 0.95; as |A| grows, through r = 1 to 1.0036; the lowest leaves through r → 0 near |A| = 1.3)
MOVING = "(r - 1.655)^4/4 + 0.1*(r - 0.5)^4/4*A - |A|/(2*0.28)*(r - 1)^2"


def _zeros(mag, sign):
    """w's zeros in r > 0 at A = sign·mag, by NumPy's polynomial roots (no code of the analysis)."""
    p = np.poly1d([1, -1.655]) ** 3 / (sign * mag) + 0.1 * np.poly1d([1, -0.5]) ** 3 - sign * np.poly1d([1, -1]) / 0.28
    return [x.real for x in p.r if abs(x.imag) < 1e-9 and x.real > 0]


def test_a_numeric_span_that_moves_with_a_is_not_cut_short_at_the_a_sampled(monkeypatch):
    """The arbiter alone (as where the hang guard fires on this objective: a budget forces it here):
    every zero of w at |A| between the rows' 1 and 1000 lies in a place the report gives for its
    sign (the span was r from 0.294 to 0.861 and from 1.0035, where at |A| = 1.91 w crosses 0 at 0.95)."""
    monkeypatch.setitem(budgets.BUDGET, "branches", -1)
    res = analyze(dsl.parse(MOVING))
    assert res.weight is None       # the arbiter's findings alone
    for side, sign in (("positive", 1.0), ("negative", -1.0)):
        for mag in (1.1, 1.25, 1.91, 5.0, 22.0, 30.0, 300.0):
            for r in _zeros(mag, sign):
                assert any(located(w, r, 0.4, sign * mag) for w in _places(res, side) if w), (side, mag, r,
                                                                                              _places(res, side))


# for A > 0, w = 1 + (r − 2.5)⁵/A below the clip's r = 0.72 and (r − 2.5)⁵/A past 1.28: the first is 0 at
# r = 2.5 − A^(1/5), inside r < 0.72 only for 18 < |A| < 98, between the rows' |A| = 1 and 1000 (found by
# tests/random_claims.py, seed 1: the derived zero was dropped, met by no row)
BETWEEN_MAGNITUDES = "(r - 2.5)^6/6 + min(r*A, clip(r, 0.72, 1.28)*A)"


@pytest.mark.parametrize("mag", [20.0, 57.0, 90.0])
def test_a_boundary_met_only_between_the_a_the_rows_sample_is_reported(mag):
    import sympy as sp
    res = analyze(dsl.parse(BETWEEN_MAGNITUDES))
    r = 2.5 - mag ** 0.2
    b = res.boundary["positive"]
    names = {k: sp.Symbol(k) for k in ("r", "mu", "A")}
    at = {names["mu"]: sp.Rational(3, 10), names["A"]: sp.Float(mag, 30)}
    implicit = [e.lhs - e.rhs for e in (sp.sympify(str(x), locals=names).subs(at) for x in b["r"]) if isinstance(e, sp.Equality)]
    changes = [sp.sign(h.subs(names["r"], sp.Float(r * (1 - 1e-6), 30))) != sp.sign(h.subs(names["r"], sp.Float(r * (1 + 1e-6), 30)))
               for h in implicit]
    assert any(changes) or any(located(x["where"], r, 0.3, mag) for x in b["numeric"]), (mag, r, b)
