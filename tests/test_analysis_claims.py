"""No confident wrong claim (issue 36 item 6): on objectives with group, band, steep and μ-dependent
terms, each claim the report states is derived or found over the region it claims. Each row is the
smallest objective that showed a wrong claim, and the claim that must not be made about it. What
the rows' comments say of each weight is checked at the points that decide it with the arbiter's
own float rules (Analysis.w_numeric: an oracle that shares the code under test, and says so)."""
import numpy as np
import pytest

from openrlhf_drpo import lang
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.report import report, to_json

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
PI_BAND = ("[π - μ <= 0.2999 or π - μ >= 0.3001]*(r*A) + "
           "[not (π - μ <= 0.2999 or π - μ >= 0.3001)]*(-|A|/(2*0.1)*(r - 1)^2)")


def _numeric_boundaries(res):
    return [b for side in res.boundary.values() for b in side["numeric"]]


def _kinds(res):
    return {k for side in res.boundary.values() for k in side["kind"]} | {b["kind"] for b in _numeric_boundaries(res)}


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
]


@pytest.mark.parametrize("text, claim, made", WRONG_CLAIMS, ids=[f"{t[:24]}: {c}" for t, c, _ in WRONG_CLAIMS])
def test_the_report_makes_no_wrong_claim_about_the_smallest_objective_that_showed_it(text, claim, made):
    res = analyze(lang.parse(text))
    assert not made(res), f"{claim}:\n{report(res)}"


def test_the_weights_the_table_rests_on_are_what_its_comments_say_by_the_arbiters_own_rules():
    def w(text, r, mu):
        return analyze(lang.parse(text)).w_numeric(np.asarray(r, dtype=float), mu, 1.0)
    assert np.all(np.abs(w(GROUP_ZERO, [0.5, 1.3, 7.0], 0.1)) <= 4.5e-16)
    steep = w(STEEP, [1.2 - 1e-9, 1.2 + 1e-9], 0.5)
    assert steep[0] > 0 > steep[1] and np.all(np.abs(steep) < 2e-6)
    assert w(EDGE_BOUND, [1 / 0.95 * (1 - 1e-9)], 0.95)[0] == 1.0     # w = 1 up to π = 1
    assert w(PI_BAND, [1 + 0.3 / 1e-9], 1e-9)[0] == pytest.approx(10 - 10 * (1 + 0.3 / 1e-9), rel=1e-9)
    assert w(LOW_BAND, [1e-21, 1e-15, 1e-9], 1.0).tolist() == [1.0, -1.0, 1.0]
    soft = analyze(lang.parse(SOFT_CLIP)).w_numeric
    r = np.geomspace(1e-3, 1e3, 61)
    for mag in (1e-3, 0.37, 1e3):
        assert soft(r, 1e-3, mag) == pytest.approx(1 / np.cosh(r - 1) ** 2, rel=1e-12)


def test_a_weight_identically_zero_says_its_rounding_in_a_note_not_as_events():
    out = to_json(analyze(lang.parse(GROUP_ZERO)))
    assert any("w = 0 (derived)" in n and "rounding" in n for n in out["notes"])
    assert all(t["kind"] == "is 0" for side in out["admissibility"]["tails"]["by_sign"].values() for t in side.values())


def test_a_boundary_on_the_domains_edge_is_proven_unreachable_and_the_one_inside_is_reachable():
    res = analyze(lang.parse(EDGE_BOUND))
    pos = res.boundary["positive"]
    by_pi = {str(p): ok for p, ok in zip(pos["pi"], pos["reachable"])}
    assert by_pi == {"221*mu/200": True, "1": False}
    edge = [c for p, c in zip(pos["pi"], res.claims["reachable"]["positive"]) if str(p) == "1"][0]
    assert edge["status"] == "proven", edge
