"""Issue 45's cases on what the analysis says of an objective that builds its own advantage Â from A
(w against Â, the host's A its input, an ε's extreme said as one), of each channel beside w on the
first screen, of a filter on a group's drift (both edges of its band, and its range), and of a
weight that is one ulp of rounding at a moved held point (not a weight)."""
import pytest

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import to_json
from openrlhf_drpo.analysis.present.summary import summary

OWN = """c = 0.01
a = seq_mean(A)
adv = (a - group_mean(a))/(group_std(a) + 1e-6)
min(r*adv, clip(r, 0.8, 1.2)*adv) + c*H"""
DRIFT_BAND = "δ = 0.02\n[|group_sum(seq_sum(log(π) - log(μ)))| <= δ]*min(r*A, clip(r, 0.8, 1.2)*A)"


def _screen(source) -> str:
    res = analyze(dsl.parse(source))
    return "\n".join(summary(res, res.source, width=None))


def test_an_advantage_the_objective_builds_is_what_w_is_against():
    res = analyze(dsl.parse(OWN))
    screen = "\n".join(summary(res, res.source, width=None))
    # the issue's wrong words: w against the host's A, whose 5e5 is the ε's
    assert "depends on |A|" not in screen and "933.668" not in screen and "500000]" not in screen
    assert "Â = adv, built from the host's A" in screen
    assert "Â/A up to 500000 only where the group's spread → 0: the 1e-06" in screen
    # PPO's clip against Â: its boundaries, bounded in [0, 1], nothing to worry about
    assert "Â > 0: at π = 6·μ/5 (r = 1.2): w is 0 beyond it" in screen
    assert "Â < 0: at π = 4·μ/5 (r = 0.8): w is 0 beyond it" in screen
    assert "bounded       yes: w ∈ [0, 1] (proven)" in screen and "worry         none found" in screen
    assert to_json(res)["advantage"]["name"] == "adv"


OWN_ADVANTAGES = [
    # (objective, Â's name, or None where w stays against the host's A)
    (OWN, "adv"),
    ("best = group_max(seq_mean(A))\nmin(r*best, clip(r, 0.8, 1.2)*best)", "best"),      # a max@k credit
    # a product chain's advantage-only factors are one Â, however the file associates them
    ("r*(A - group_mean(A))/(group_std(A) + 1e-6)", "(A - group_mean(A)) / (group_std(A) + 1e-06)"),
    ("s = clip(A, -1, 1)\nmin(r*s, clip(r, 0.8, 1.2)*s)", "s"),      # a clipped advantage
    ("min(r*A, clip(r, 0.8, 1.2)*A)", None),
    ("r*seq_mean(A)", None),        # A itself in every host
    ("r*A*H", None),
    ("[A - group_mean(A) > 0]*r*A", "[A - group_mean(A) > 0] * A"),       # a mask of A is a shaped advantage
    # A in a sum or a min is no multiplier: OAPL's regression target stays against A
    ("R = seq_mean(A)\n-(0.001*seq_sum(log(π) - log(μ)) - (R - group_mean(R)))^2", None),
    ("min(r*A, A - group_mean(A))", None),
]


@pytest.mark.parametrize("source, name", OWN_ADVANTAGES)
def test_the_objectives_own_advantage_is_found_by_its_rule(source, name):
    res = analyze(dsl.parse(source))
    assert (res.advantage and res.advantage["name"]) == name


def test_an_advantage_bounded_only_by_its_epsilon_says_so_and_one_that_is_not_does_not():
    assert "only where |A| → 0: the 0.001" in _screen("adv = A/(|A| + 1e-3)\nr*adv")
    assert "only where" not in _screen("adv = (A - group_mean(A))/1.5\nr*adv")


CHANNELS = [
    ("entropy_bonus", "  entropy       + c·H: an entropy bonus, 0.01 per token, with its gradient through H"),
    ("top_entropy", "  entropy       H is read without a gradient through it (w_H = 0)"),
    ("grpo_k3", "  reference     the terms that read π_ref: its own channel beside w, ∂ℓ_ref/∂log π = β·(q − 1)"),
    ("otb", "  Σπ²           Σ_v π_v² enters without a gradient (the host detaches it)"),
]


@pytest.mark.parametrize("name, line", CHANNELS)
def test_each_channel_has_its_line_on_the_first_screen(name, line):
    res = analyze(dsl.load(name))
    assert any(x.startswith(line) for x in summary(res, res.source, width=None))


def test_a_filter_on_a_groups_drift_keeps_both_edges_of_its_band_and_its_range():
    import math
    res = analyze(dsl.parse(DRIFT_BAND))
    for adv in ("positive", "negative"):
        edges = sorted(float(r) for r in res.boundary[adv]["r"])
        assert edges == pytest.approx([math.exp(-0.0025), math.exp(0.0025)], rel=1e-12)
        assert all(res.boundary[adv]["reachable"])
    assert res.bounded and res.weight_range == [0.0, 1.0]


@pytest.mark.parametrize("source", ["r*A*(r/group_mean(r) - 1)", "r/group_mean(r)*A", "(r/group_mean(r) - 1)*A"])
def test_one_ulp_at_a_moved_held_point_is_not_read_as_a_weight(source):
    # w = 0 at every uniform batch (group_mean(r) = r there): the doubles' 2.2e-16 is rounding
    res = analyze(dsl.parse(source))
    assert not any(a.kind == "degenerate held point" for a in res.warnings)
    assert {res.claims["boundary"][adv]["status"] for adv in ("positive", "negative")} == {"proven"}


def test_a_sign_an_advantage_sends_to_0_gets_no_gradient_and_says_so():
    # [A < 0]·A is Â: w ≡ 1 against it, and the tokens with A > 0 get no gradient at all
    res = analyze(dsl.parse("[A < 0]*r*A"))
    screen = "\n".join(summary(res, res.source, width=None))
    assert "Â = [A < 0] * A" in screen and "Â = 0 for A > 0: those tokens get no gradient" in screen
    assert res.weight_range == [1.0, 1.0]


def test_a_product_of_shared_bindings_is_never_written_out_as_a_tree():
    """b_i = b_(i-1)·b_(i-1) up to b39 is r^(2^39): 40 nodes as a DAG, 2^39 factors as a tree. The rule
    that finds Â flattened every product chain as a tree (a MemoryError after minutes, from 28 bindings
    on: benchmarks/analyze_speed.py's chained_bindings_40); it flattens at most MAX_FACTORS and keeps the
    rest whole, so the analysis ends (w itself beyond the derivation's budget), and b39*A's advantage
    is the host's own."""
    from openrlhf_drpo.analysis.batch.advantage import MAX_FACTORS, _factors, own_advantage
    source = "\n".join(["b0 = r"] + [f"b{i} = b{i - 1}*b{i - 1}" for i in range(1, 40)] + ["b39*A"])
    obj = dsl.parse(source)
    assert len(_factors(obj.expr)) <= MAX_FACTORS
    assert own_advantage(obj) is None
    res = analyze(obj)
    assert res.advantage is None
