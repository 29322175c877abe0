"""No confident wrong claim (issue 36 item 6): on objectives with group, band, steep and μ-dependent
terms, each claim the report states is derived or found over the region it claims. Each row is the
smallest objective that showed a wrong claim, and the claim that must not be made about it. What
the rows' comments say of each weight is checked at the points that decide it with the arbiter's
own float rules (Analysis.w_numeric: an oracle that shares the code under test, and says so)."""
import numpy as np
import pytest

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report, to_json

# w = 0 exactly on a uniform group, which the doubles give as ±2.2e-16
GROUP_ZERO = "r*A*(r/group_mean(r) - 1)"
# w = 1100·(1.2 − r)·e^(−100(r − 1.2)²): a continuous crossing of slope −1100 where the row's
# median |w| is below 1e-40
STEEP = "A*5.5*exp(-100*(r - 1.2)^2)"
# the clip's upper bound is 1/μ (π = 1, the domain's edge) for μ > 200/221 ≈ 0.905
EDGE_BOUND = "min(r*A, clip(r, 0.8, min(1.105, 1/μ))*A)"
# bands 1e-4 wide in r, and 2e-4 wide in π − μ, on r > 1 only
R_BAND = "r*A - [r > 1.1 and r < 1.1001]*|A|*(r - 1)^2*100"
# w = −1 on the band 1e-20 < r < 1e-10, below the grid's smallest r (1e-15), and 1 elsewhere
LOW_BAND = "r*A - [r > 1e-20 and r < 1e-10]*2*r*A"
# w = sech²(r − 1): the formula names |A| (2^log|A| is |A|^log 2), the weight does not depend on it
SOFT_CLIP = "A*tanh((r - 1)*2^log(|A|)/|A|^log(2))"
# w = sech²(|A|(r − 1)) ∈ (0, 1]: at |A| = 1000 a peak 1e-3 wide at r = 1, sharp on the grid, not a pole
SHARP_PEAK = "A*tanh(|A|*(r - 1))/|A|"
# w = 1 + 5·e^(−x²)(1 − 2000·r·x), x = 1000(r − 1.5): a bump 1e-3 wide, |w| ≤ 6434.23, no pole
BUMP = "r*A*(1 + 5*exp(-(1000*(r - 1.5))^2))"
# w = 3.5e6/(1e6·√14·|A| + 7) at the held group: it grows as |A| → 0 but only to 5e5, at every r and μ
SMALL_A = "adv = (A - group_mean(A))/(group_std(A) + 1e-6)\nr*adv"
# OTB: B = 4AW/(8W + 1e-8), W = 2(π² − π + 1 − μ) at the held group, < 0 off policy for μ > 3/4: a
# pole 1e-9 wide in π where 8W = −1e-8 (μ = 0.9, π = 0.8872983338), between the grid's points
OTB_POLE = """W = prefix_sum(1 - 2π_old + sum_π_sq)
B = [group_count(A) >= 2]*group_sum(A*W)/(group_sum(W) + 1e-8)
adv = A - B
min(r*adv, clip(r, 0.8, 1.2)*adv)"""
PI_BAND = ("[π - μ <= 0.2999 or π - μ >= 0.3001]*(r*A) + "
           "[not (π - μ <= 0.2999 or π - μ >= 0.3001)]*(-|A|/(2*0.1)*(r - 1)^2)")


def _numeric_boundaries(res):
    return [b for side in res.boundary.values() for b in side["numeric"]]


def _kinds(res):
    return {k for side in res.boundary.values() for k in side["kind"]} | {b["kind"] for b in _numeric_boundaries(res)}


def _sure_bounded(res):
    line = next(x for x in report(res).splitlines() if x.strip().startswith("bounded "))
    return res.claims["bounded"]["status"] != "proven" and line.strip().startswith("bounded             yes") \
        and "unconfirmed" not in line


WRONG_CLAIMS = [
    # (objective, the claim that must not be made, whether it is made)
    (GROUP_ZERO, "numeric boundaries where w ≡ 0", lambda res: bool(_numeric_boundaries(res))),
    (GROUP_ZERO, "a range other than [0, 0] where w ≡ 0", lambda res: res.weight_range != [0.0, 0.0]),
    (GROUP_ZERO, "smooth: no where w ≡ 0", lambda res: not res.smooth),
    (GROUP_ZERO, "w touches 0 where w ≡ 0", lambda res: any(a.kind == "touches" for a in res.warnings)),
    (STEEP, "a jump at a steep continuous crossing", lambda res: "jumps across 0" in ", ".join(_kinds(res))),
    (STEEP, "smooth: no for a continuous weight", lambda res: not res.smooth),
    (EDGE_BOUND, "the bound 1/μ (π = 1) reachable",
     lambda res: any(ok for p, ok in zip(res.boundary["positive"]["pi"], res.boundary["positive"]["reachable"])
                     if str(p) == "1")),
    (R_BAND, "symmetric in log r for a band on r > 1 only", lambda res: res.admissibility["symmetric_log_r"]["value"]),
    (PI_BAND, "symmetric in log r for a band on r > 1 only", lambda res: res.admissibility["symmetric_log_r"]["value"]),
    (PI_BAND, "bounded for a band whose w grows as 1/μ", lambda res: res.bounded is not False),
    (LOW_BAND, "a band's upper edge without its lower edge", lambda res: any(
        {str(r) for r in side["r"]} != {"1/100000000000000000000", "1/10000000000"} for side in res.boundary.values())),
    (SOFT_CLIP, "advantage-entangled where w does not depend on |A|", lambda res: res.geometry == "advantage-entangled"),
    (SOFT_CLIP, "the weight depends on |A| where it does not", lambda res: any(a.kind == "entangled" for a in res.warnings)),
    (SHARP_PEAK, "a pole at a finite peak", lambda res: bool(res.arbiter["poles"]) or not res.smooth),
    (SHARP_PEAK, "unbounded where w ∈ (0, 1]", lambda res: res.bounded is not True or res.weight_range[1] > 1 + 1e-9),
    (BUMP, "a pole at a finite bump", lambda res: bool(res.arbiter["poles"]) or not res.smooth),
    (BUMP, "unbounded where |w| ≤ 6434.23", lambda res: res.bounded is not True),
    (SMALL_A, "unbounded where w ≤ 5e5", lambda res: res.bounded is not True or res.weight_range[1] > 5e5),
    (SMALL_A, "extreme ratios dominate where w does not read r",
     lambda res: any(a.kind.startswith("unbounded") for a in res.warnings)),
    (OTB_POLE, "bounded across a pole", lambda res: res.bounded is not False or not res.arbiter["poles"]),
    (OTB_POLE, "bounded: yes, unqualified, while the range is unconfirmed", lambda res: _sure_bounded(res)),
    (R_BAND, "bounded: yes, unqualified, while the range is unconfirmed", lambda res: _sure_bounded(res)),
]


@pytest.mark.parametrize("text, claim, made", WRONG_CLAIMS, ids=[f"{t[:24]}: {c}" for t, c, _ in WRONG_CLAIMS])
def test_the_report_makes_no_wrong_claim_about_the_smallest_objective_that_showed_it(text, claim, made):
    res = analyze(dsl.parse(text))
    assert not made(res), f"{claim}:\n{report(res)}"


def test_the_weights_the_table_rests_on_are_what_its_comments_say_by_the_arbiters_own_rules():
    def w(text, r, mu):
        return analyze(dsl.parse(text)).w_numeric(np.asarray(r, dtype=float), mu, 1.0)
    assert np.all(np.abs(w(GROUP_ZERO, [0.5, 1.3, 7.0], 0.1)) <= 4.5e-16)
    steep = w(STEEP, [1.2 - 1e-9, 1.2 + 1e-9], 0.5)
    assert steep[0] > 0 > steep[1] and np.all(np.abs(steep) < 2e-6)
    assert w(EDGE_BOUND, [1 / 0.95 * (1 - 1e-9)], 0.95)[0] == 1.0     # w = 1 up to π = 1
    assert w(PI_BAND, [1 + 0.3 / 1e-9], 1e-9)[0] == pytest.approx(10 - 10 * (1 + 0.3 / 1e-9), rel=1e-9)
    assert w(LOW_BAND, [1e-21, 1e-15, 1e-9], 1.0).tolist() == [1.0, -1.0, 1.0]
    soft = analyze(dsl.parse(SOFT_CLIP)).w_numeric
    r = np.geomspace(1e-3, 1e3, 61)
    for mag in (1e-3, 0.37, 1e3):
        assert soft(r, 1e-3, mag) == pytest.approx(1 / np.cosh(r - 1) ** 2, rel=1e-12)


def test_the_peaks_and_poles_the_new_rows_rest_on_are_what_their_comments_say_by_the_arbiters_own_rules():
    def w(text, r, mu, mag=1.0):
        return analyze(dsl.parse(text)).w_numeric(np.asarray(r, dtype=float), mu, mag)
    r = np.linspace(0.99, 1.01, 2001)
    assert w(SHARP_PEAK, r, 0.5, 1e3) == pytest.approx(1 / np.cosh(1e3 * (r - 1)) ** 2, rel=1e-9, abs=1e-300)
    bump = w(BUMP, np.linspace(1.49, 1.51, 200001), 0.5)
    assert 6434 < bump.max() < 6434.3 and -6432.3 < bump.min() < -6432
    held = analyze(dsl.parse(SMALL_A), own_advantage=False).w_numeric     # (against A, not its own Â)
    for mag in (1e-12, 1e-3, 1e3):
        assert held(np.array([1e-6, 1.0, 1e6]), 1e-6, mag) == pytest.approx(3.5e6 / (1e6 * 14 ** 0.5 * mag + 7))
    pole = (1 + np.sqrt(1 - 4 * (0.1 + 6.25e-10))) / 2 / 0.9       # π² − π + 0.1 + 1e-8/16 = 0
    for h, size in ((1e-10, 4), (1e-12, 4e2)):      # |w| 100 times larger 100 times closer, either sign
        near = w(OTB_POLE, [pole * (1 - h), pole * (1 + h)], 0.9)
        assert np.all(np.abs(near) > size) and near[0] < 0 < near[1]


def test_the_admissibility_says_bounded_as_surely_as_the_range_and_the_advantage_when_it_is_the_cause():
    out = report(analyze(dsl.parse(R_BAND)))
    assert "bounded             yes: w ∈ [" in out and "(unconfirmed, as the range above)" in out
    grows = analyze(dsl.parse("r*A + r"))      # w = 1 + 1/A: unbounded as |A| → 0 at every r
    assert [a.kind for a in grows.warnings if a.kind.startswith("unbounded")] == ["unbounded in |A|"]


def test_a_weight_identically_zero_says_its_rounding_in_a_note_not_as_events():
    out = to_json(analyze(dsl.parse(GROUP_ZERO)))
    assert any("w = 0 (derived)" in n and "rounding" in n for n in out["notes"])
    assert all(t["kind"] == "is 0" for side in out["admissibility"]["tails"]["by_sign"].values() for t in side.values())


def test_a_boundary_on_the_domains_edge_is_proven_unreachable_and_the_one_inside_is_reachable():
    res = analyze(dsl.parse(EDGE_BOUND))
    pos = res.boundary["positive"]
    by_pi = {str(p): ok for p, ok in zip(pos["pi"], pos["reachable"])}
    assert by_pi == {"221*mu/200": True, "1": False}
    edge = [c for p, c in zip(pos["pi"], res.claims["reachable"]["positive"]) if str(p) == "1"][0]
    assert edge["status"] == "proven", edge
