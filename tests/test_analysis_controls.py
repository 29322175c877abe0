"""drpo-analyze on an objective with memory (issue 48): a controlled parameter is analysed over its
declared bounds, and the report says the weight's range and boundaries as it moves across them; a
schedule is analysed at step 0 and where it stops changing; --equiv compares two objectives with
memory at those values, or refuses controllers that differ by name."""
import functools
import json
import os
from pathlib import Path

import pytest

import dsl
from openrlhf_drpo.analysis.memory import has_memory, reads_step, settles
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report, to_json
from openrlhf_drpo.analysis.present.summary import summary
from openrlhf_drpo.cli import analyze_main

PPO = "min(r*A, clip(r, 1 - ε, 1 + ε)*A)"
KL = "batch_mean(log(π_old) - log(π_ref))"
# a clip range steered by the step's KL: w reads ε, so the trust region moves with it
CLIP_CONTROLLED = f"ε = 0.2\nε ← ε·(1 + clip({KL}/6 - 1, -0.2, 0.2)/100) in [0.1, 0.3]\n{PPO}"


def _objective(text):
    return dsl.load(text) if text in dsl.shipped_names() else dsl.parse(text, "controlled.dsl")


@functools.lru_cache(maxsize=None)
def _analysed(text):
    return analyze(_objective(text))


def _first_screen(text) -> str:
    return " ".join(summary(_analysed(text), _analysed(text).source, width=None))


def _rows(text, part="bounds"):
    return {row["at"]: row for row in _analysed(text).memory[part]["rows"]}


def test_adaptive_kl_names_betas_rule_and_bounds_and_the_trust_region_at_both_ends():
    said = _first_screen("adaptive_kl")
    assert "β ← β·(1 + clip(KL/kl_target - 1, -0.2, 0.2)·n/horizon) in [0, 10], after each optimizer step" in said
    assert "At β = 0, 0.05 and 10:" in said
    assert "w ∈ [0, 1] and the trust region (A > 0: r = 1.2; A < 0: r = 0.8) at each" in said
    rows = _rows("adaptive_kl")
    assert list(rows) == ["β = 0", "β = 0.05", "β = 10"]
    for at in ("β = 0", "β = 10"):      # each end analysed on its own, not copied from the first step's
        claims = rows[at]["claims"]
        assert (claims["trust region A > 0"], claims["trust region A < 0"], claims["range"]) == \
            ("r = 1.2", "r = 0.8", "w ∈ [0, 1]")
    assert [rows[at]["role"] for at in rows] == ["lower bound", None, "upper bound"] and rows["β = 0.05"]["above"]


def test_what_beta_moves_is_the_reference_channel_from_zero_to_its_upper_bound():
    rows = _rows("adaptive_kl")
    assert [rows[at]["claims"]["reference channel"] for at in rows] == \
        ["∂ℓ_ref/∂log π = 0", "∂ℓ_ref/∂log π = -0.05", "∂ℓ_ref/∂log π = -10"]
    assert _analysed("adaptive_kl").memory["bounds"]["changes"] == ["reference channel"]
    assert "the reference channel moves from ∂ℓ_ref/∂log π = 0 at β = 0 to ∂ℓ_ref/∂log π = -10 at β = 10" in \
        _first_screen("adaptive_kl")


@pytest.mark.parametrize("text, name", [("adaptive_kl", "β"), ("kl_loss_ctrl", "β"), ("adaptive_entropy", "α"),
                                        ("adaptive_entropy", "on")])
def test_an_objective_whose_w_does_not_read_the_controlled_parameter_says_so(text, name):
    res = _analysed(text)
    control = next(c for c in res.memory["controls"] if c["shown"] == name)
    assert control["w_reads"] is False
    assert f"w does not read {name} (∂ℓ/∂r of w's terms has no {name}): what the report says of w holds for every " \
           f"{name} in [{control['low']:g}, {control['high']:g}]" in report(res, width=None)
    assert {"w", "range", "trust region A > 0", "trust region A < 0"} <= set(res.memory["bounds"]["same"])


def test_a_controlled_clip_range_moves_the_boundary_from_its_lower_to_its_upper_bound():
    said = _first_screen(CLIP_CONTROLLED)
    assert "the trust region for A > 0 moves from r = 1.1 at ε = 0.1 to r = 1.3 at ε = 0.3" in said
    assert "the trust region for A < 0 moves from r = 0.9 at ε = 0.1 to r = 0.7 at ε = 0.3" in said
    rows = _rows(CLIP_CONTROLLED)     # w reads ε: the midpoints are analysed too
    assert {at: r["claims"]["trust region A > 0"] for at, r in rows.items()} == {
        "ε = 0.1": "r = 1.1", "ε = 0.15": "r = 1.15", "ε = 0.2": "r = 1.2", "ε = 0.25": "r = 1.25", "ε = 0.3": "r = 1.3"}
    text = report(_analysed(CLIP_CONTROLLED), width=None)
    assert "w reads ε: between these values nothing is analysed (--set eps=X analyses X in [0.1, 0.3])" in text
    assert "w does not read" not in text


def test_two_controls_are_analysed_at_every_combination_of_their_bounds():
    # on·α·H: α alone (on = 0) or on alone (α = 0) never shows the bonus; only α = on = 1 does
    rows = _rows("adaptive_entropy")
    assert {at: r["claims"]["entropy channel"] for at, r in rows.items()} == {
        "α = 0, on = 0": "w_H = 0", "α = 0, on = 1": "w_H = 0", "α = 1, on = 0": "w_H = 0", "α = 1, on = 1": "w_H = 1"}
    assert "the entropy channel moves from w_H = 0 at α = 0, on = 0 to w_H = 1 at α = 1, on = 1" in \
        _first_screen("adaptive_entropy")


def test_a_bound_where_the_objective_is_not_analysable_is_said_at_that_bound():
    text = "δ = 0.5\nδ ← δ·(1 + clip(batch_mean(H) - 1, -0.1, 0.1)) in [0, 1]\nr*A - |A|/(2δ)*(r - 1)^2"
    rows = _rows(text)
    assert rows["δ = 0"]["claims"] is None and "division by zero" in rows["δ = 0"]["error"]
    assert rows["δ = 1"]["claims"] is not None
    assert "not analysable at δ = 0" in _first_screen(text)
    assert "δ = 0 (lower bound)   not analysable: division by zero" in report(_analysed(text), width=None)


def test_a_schedule_is_analysed_at_step_0_and_where_it_stops_changing():
    sc = _analysed("clip_schedule").memory["schedule"]
    assert (sc["step"], sc["settles"]) == (0, 10000)
    assert sc["values"] == [{"name": "ε", "at": [[0, 0.1], [10000, 0.0]]}]
    rows = {r["at"]: r["claims"] for r in sc["rows"]}
    assert rows["step = 0"]["trust region A > 0"] == "r = 1.1" and rows["step = 10000"]["trust region A > 0"] == "r = 1"
    said = _first_screen("clip_schedule")
    assert "reads step, the optimizer step's index: analysed above at step 0, here also at step 10,000" in said
    assert "ε = 0.1 at step 0, 0 at step 10,000" in said and "--set step=N analyses step N" in said


def test_set_step_analyses_that_step_and_says_the_clip_range_there(capsys):
    assert analyze_main(["clip_schedule", "--set", "step=5000"]) == 0
    out = capsys.readouterr().out
    head = out[:out.index("\nevidence")]
    assert "A > 0: at π = 21·μ/20 (r = 1.05)" in head and "A < 0: at π = 19·μ/20 (r = 0.95)" in head
    assert "analysed above at step 5000" in head and "ε = 0.1 at step 0, 0.05 at step 5000, 0 at step 10,000" in head


@pytest.mark.parametrize("schedule, settled", [
    ("0.2 + 0.08*min(step/500, 1)", 500),
    ("0.1*max(1 - step/3333, 0)", 3333),          # between two steps of the grid: found by bisection
    ("0.2 + 0*step", 0),                          # reads step, never changes
    ("0.1 + 0.1/(1 + step)", None),               # still changing at the last step followed
])
def test_a_schedule_settles_where_its_values_stop_changing(schedule, settled):
    obj = dsl.parse(f"ε = {schedule}\n{PPO}", "schedule.dsl")
    assert settles(obj) == settled


def test_a_step_read_bare_in_the_objective_never_settles():
    assert settles(dsl.parse("r*A*step", "bare.dsl")) is None


def test_the_json_holds_the_rows_and_an_objective_without_memory_has_none():
    out = json.loads(json.dumps(to_json(_analysed("adaptive_kl")), ensure_ascii=False))
    assert [row["values"] for row in out["memory"]["bounds"]["rows"]] == [{"beta": 0.0}, {"beta": 0.05}, {"beta": 10.0}]
    assert "memory" not in to_json(analyze(dsl.load("ppo")))


# β·KL against 20β²·KL: the same at β = 0 and at the first step's β = 0.05, not at β = 10
SAME_CONTROLLER = "β = 0.05\nβ ← β·(1 + clip(batch_mean(log(π_old) - log(π_ref))/6 - 1, -0.2, 0.2)/1000) in [0, 10]\n"


def test_equiv_compares_objectives_with_the_same_controller_at_its_bounds(tmp_path, capsys):
    a, b = tmp_path / "a.dsl", tmp_path / "b.dsl"
    a.write_text(SAME_CONTROLLER + f"{PPO.replace('ε', '0.2')} - β·(log(π) - log(π_ref))\n", encoding="utf-8")
    b.write_text(SAME_CONTROLLER + f"{PPO.replace('ε', '0.2')} - 20·β^2·(log(π) - log(π_ref))\n", encoding="utf-8")
    assert analyze_main([str(a), str(b), "--equiv"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("not equivalent") and "compared at β = 0; β = 0.05; β = 10" in out
    assert "the verdict below is at β = 10" in out
    assert analyze_main(["adaptive_kl", "adaptive_kl", "--equiv"]) == 0
    assert "compared at β = 0; β = 0.05; β = 10" in capsys.readouterr().out


@pytest.mark.parametrize("other", ["ppo", "adaptive_kl:kl_target=3", "adaptive_kl:beta=3"])
def test_equiv_refuses_controllers_that_differ_by_name_at_the_update_line(other, capsys):
    assert analyze_main(["adaptive_kl", other, "--equiv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("objectives/adaptive_kl.dsl:16:1: error: --equiv: adaptive_kl updates β after each step")
    assert "comparing one step's gradients does not settle" in err


GOLDEN = Path(__file__).parent / "golden" / "memory"
MEMORY = [n for n in dsl.shipped_names() if has_memory(dsl.load(n))]


def _memory_lines(text: str) -> str:
    """The report's lines about memory: the first screen's, then the evidence's sections, unwrapped."""
    lines = report(_analysed(text), width=None).splitlines()
    out = [line for line in lines[:lines.index("evidence")] if line.startswith(("  memory  ", "  schedule  "))]
    inside = False
    for line in lines[lines.index("evidence"):]:
        inside = line.startswith(("  memory     ", "  schedule   ")) or (inside and line.startswith("    "))
        out += [line] * inside
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("name", [*MEMORY, "clip_controlled"])
def test_every_shipped_objective_with_memory_says_it_as_its_golden(name):
    # regenerate: DRPO_UPDATE_GOLDEN=1 pytest tests/test_analysis_controls.py -k golden, then read the diff
    got = _memory_lines(CLIP_CONTROLLED if name == "clip_controlled" else name)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("DRPO_UPDATE_GOLDEN"):
        path.write_text(got, encoding="utf-8")
    assert got == path.read_text(encoding="utf-8")


def test_the_library_has_objectives_with_memory_of_each_kind():
    kinds = {n: (bool(dsl.load(n).controls), reads_step(dsl.load(n))) for n in MEMORY}
    assert (True, False) in kinds.values() and (False, True) in kinds.values(), kinds


def test_a_controlled_parameter_in_the_objectives_own_advantage_moves_it_and_w_against_it_says_so():
    text = ("β = 0.5\nβ ← β + 0.01*(batch_mean(H) - 1) in [0, 1]\n"
            "min(r*(A - β*group_mean(A)), clip(r, 0.8, 1.2)*(A - β*group_mean(A)))")
    rows = _rows(text)
    assert {at: r["claims"]["advantage"] for at, r in rows.items()} == {
        "β = 0": "Â = A", "β = 0.5": "Â = 3·A/4", "β = 1": "Â = A/2"}     # the held group A·(1, 1, 1, 1, 0, 0, 0, 0)
    assert "the advantage Â moves from Â = A at β = 0 to Â = A/2 at β = 1" in _first_screen(text)
    assert "w (against Â) does not read β" in report(_analysed(text), width=None)


def test_many_controlled_parameters_are_analysed_each_alone_past_the_combinations_budget():
    text = "".join(f"{p} = 0.5\n{p} ← {p} + 0.01*(batch_mean(H) - 1) in [0, 1]\n" for p in "abc") + \
        "min(r*A, clip(r, 0.8, 1.2)*A) + a*H + b*H + c*H"
    rows = _rows(text)
    assert len(rows) == 7 and "a = 0.5, b = 0.5, c = 0.5" in rows        # 27 combinations > POINTS
    assert "At each one's bounds, the others at their first values:" in _first_screen(text)
