"""Scenarios (issue 45 items 1 and 3): the situations that change an objective's gradient, derived
from its constructs, each claim on the first screen and held to the compiled loss's gradient on that
scenario's batch (CompiledLoss's plain path, float64: an oracle that is the loss itself, not the
analysis); --equiv decides over every scenario of both objectives and says its scope."""
import json
import subprocess
import sys

import pytest

import dsl
from openrlhf_drpo.analysis import analyze, equivalent
from openrlhf_drpo.analysis.present.report import report, to_json
from openrlhf_drpo.analysis.batch.scenarios import scenario_analysis
from openrlhf_drpo.cli import analyze_main
from scenario_objectives import draws

# DAPO's zero-variance filter, as a new user writes it from docs/language.md (the file)
DAPO_ZV = ("ε_low = 0.2\nε_high = 0.28\nkeep = [group_std(seq_mean(A)) > 0]\n"
           "keep*min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)\n")
FILTER = "[group_std(seq_mean(A)) > 0]"


@pytest.fixture
def dapo_zv(tmp_path):
    path = tmp_path / "dapo_zv.dsl"
    path.write_text(DAPO_ZV)
    return str(path)


def first_screen(res):
    lines = report(res).splitlines()
    return "\n".join(lines[:lines.index("evidence")])


def test_dapos_filter_is_on_the_first_screen_where_it_fires(dapo_zv):
    """The filter's reason to exist, a zero-variance group getting no gradient, is said on the
    first screen, where the default held group (a spread) never shows it."""
    head = " ".join(first_screen(analyze(dapo_zv)).split())
    assert f"a zero-variance group (all right or all wrong): no gradient, the filter {FILTER} is 0" in head
    assert f"a group of one response (G = 1): no gradient, the filter {FILTER} is 0" in head


@pytest.mark.parametrize("text, names", [
    ("r*A", []),
    (DAPO_ZV, ["zero-variance", "one-success", "one-failure", "group-of-one", "one-token", "long-response"]),
    ("r*A - 0.1*group_mean(r)", ["group-of-one"]),
    ("r*(group_max(seq_mean(A)) - group_mean(seq_mean(A)))",
     ["zero-variance", "one-success", "one-failure", "group-of-one", "attains", "not-attaining", "tie",
      "one-token", "long-response"]),
    ("seq_mean(r)*A - 0.001*seq_len", ["one-token", "long-response", "truncated"]),
    ("prefix_mean(r)*A", ["first-token", "last-token"]),
    ("r*A*exp(-0.1*staleness)", ["fresh", "stale"]),
    ("r*(A - batch_mean(seq_mean(A)))",
     ["zero-variance", "one-success", "one-failure", "group-of-one", "one-token", "long-response"]),
])
def test_scenarios_are_derived_from_the_objectives_constructs(text, names):
    res = analyze(dsl.parse(text, "s.dsl"))
    assert [s["name"] for s in (res.scenarios or {"scenarios": []})["scenarios"]] == names


@pytest.mark.parametrize("text, said", [
    ("c = 0.5\n[c > 0.2]*r*A", "[c > 0.2] is 1 on every scenario at every point sampled: always on"),
    ("[group_count(r) > 100]*r*A + 0.1*r",
     "[group_count(r) > 100] is 0 on every scenario at every point sampled: dead, no gradient passes it"),
])
def test_an_indicator_constant_on_every_scenario_is_said_on_the_first_screen(text, said):
    assert said in " ".join(first_screen(analyze(dsl.parse(text, "i.dsl"))).split())


@pytest.mark.parametrize("text, state", [
    ("[group_mean(seq_mean(A)) > 0]*r*A", "switches"),
    ("[A > 0]*r*A", "with the token"),
    ("[0.3 < μ and μ < 0.31]*r*A", "with the token"),      # a band between the grid's μ: never called dead
    ("[H >= batch_quantile(H, 0.8)]*r*A", "with the token"),
    ("[group_std(seq_mean(r)) == 0]*r*A", "always on at the held point only"),     # a tie on the uniform batch
])
def test_an_indicator_is_called_constant_only_where_the_scenarios_decide_it(text, state):
    (ind,) = analyze(dsl.parse(text, "i.dsl")).scenarios["indicators"]
    assert ind["state"] == state


def test_the_scenarios_are_listed_and_one_is_analysed_from_the_command_line(dapo_zv, capsys):
    assert analyze_main(["--scenarios", dapo_zv]) == 0
    listed = capsys.readouterr().out
    assert "zero-variance" in listed and "one-success" in listed and "no gradient" in listed
    assert analyze_main(["--scenario", "zero-variance", "--json", dapo_zv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"] == "zero-variance"
    (G,) = [h for h in out["scope"]["held"] if h["name"] == "G"]
    assert G["group"] == [1.0] * 8


def test_an_unknown_scenario_is_refused_with_the_objectives_list(dapo_zv, capsys):
    with pytest.raises(SystemExit) as exit_:
        analyze_main(["--scenario", "all-wrong", dapo_zv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "has no scenario 'all-wrong'" in err and "zero-variance" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("scenario, flags, named", [
    ("zero-variance", ["--group", "1,0"], "--group"),                 # was analysed at (1, 1, 1), --group dropped
    ("long-response", ["--seq-len", "7"], "--seq-len 7"),             # was analysed at |y| = 1024
])
def test_a_setting_the_scenario_would_replace_is_refused_by_name_not_dropped(dapo_zv, capsys, scenario, flags, named):
    with pytest.raises(SystemExit) as exit_:
        analyze_main(["--scenario", scenario, *flags, dapo_zv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"would replace the given {named}" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="would replace the given --group"):
        analyze(dapo_zv, scenario="zero-variance", group=[1, 0])


def test_the_api_analyses_a_scenario_and_gives_its_name(dapo_zv):
    res = analyze(dapo_zv, scenario="one-success")
    assert res.scenario == "one-success" and to_json(res)["scenario"] == "one-success"


def test_each_scenarios_claim_agrees_with_the_compiled_loss(dapo_zv):
    checks = {s["name"]: s["loss_check"] for s in analyze(dapo_zv, check_loss=True).scenarios["scenarios"]}
    assert {k: c["status"] for k, c in checks.items()} == dict.fromkeys(checks, "agrees")


def test_without_torch_the_check_is_reported_not_run(dapo_zv, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch raises ImportError, as without it
    monkeypatch.delitem(sys.modules, "openrlhf_drpo.core", raising=False)
    sc = scenario_analysis(dsl.load(dapo_zv), 1.0, {"seq_len": 1}, check_loss=True)
    assert {s["loss_check"]["status"] for s in sc["scenarios"]} == {"not run"}
    assert "torch is not installed" in sc["scenarios"][0]["loss_check"]["why"]
    assert "the compiled loss's check not run: torch is not installed" in " ".join(
        report(analyze(dapo_zv, check_loss=True)).split())


def test_the_analyser_only_install_imports_the_scenarios_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from openrlhf_drpo.analysis.batch.scenarios import derive\n"
            "from openrlhf_drpo.analysis import analyze\n"
            "print(analyze('grpo_clip_higher').scenarios)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr


def test_the_compiled_loss_closes_the_zero_variance_filter_on_equal_rewards_of_any_value(dapo_zv):
    import math

    import torch

    from openrlhf_drpo.core import CompiledLoss
    old = torch.full((8, 1), math.log(0.3), dtype=torch.float64)
    logp = (old + math.log(0.9)).requires_grad_()
    loss, _ = CompiledLoss(dsl.load(dapo_zv), fused=False)(logp, old, torch.full((8, 1), 0.7, dtype=torch.float64),
                                                           torch.ones(8, 1, dtype=torch.bool),
                                                           groups=torch.zeros(8, dtype=torch.long))
    assert float(torch.autograd.grad(loss, logp)[0].abs().max()) == 0.0


# ---------------------------------------------------------------- --equiv over scenarios
def test_equiv_does_not_call_a_zero_variance_filter_equivalent_to_no_filter(dapo_zv, capsys):
    """The issue's case: exit 0 'equivalent' before; now exit 1, equivalent except on a zero-variance
    group with raw advantages, and the verdict says it depends on the host's normalization of A."""
    assert analyze_main(["--equiv", dapo_zv, "grpo_clip_higher"]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("equivalent except on a zero-variance group (all right or all wrong)")
    assert "with raw advantages" in first
    assert "the verdict depends on the host's normalization of A" in out


def test_equiv_at_a_zero_variance_group_is_not_equivalent(dapo_zv, capsys):
    assert analyze_main(["--equiv", "--group", "1,1,1,1", dapo_zv, "grpo_clip_higher"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == "not equivalent: dapo_zv and grpo_clip_higher"


def test_equiv_says_its_scope_when_every_scenario_agrees(capsys):
    text = "keep = [group_std(seq_mean(A)) >= 0]\nkeep*min(r*A, clip(r, 0.8, 1.28)*A)"
    res = equivalent(dsl.parse(text, "k.dsl"), "grpo_clip_higher")
    assert res["equivalent"] and {s["status"] for s in res["scenarios"]} == {"same"}
    from openrlhf_drpo.analysis.present.equiv_report import equivalence_report
    assert "  scenarios  equivalent on every scenario (zero-variance, one-success" in equivalence_report(res)


def test_the_equiv_api_gives_the_command_lines_verdict(dapo_zv):
    res = equivalent(dapo_zv, "grpo_clip_higher")
    zero = [s for s in res["scenarios"] if s["name"] == "zero-variance"]
    assert not res["equivalent"] and zero[0]["status"] == "differs" and zero[0]["normalized_same"] is True
    assert not equivalent(dapo_zv, "grpo_clip_higher", group=(1, 1, 1, 1))["gradient_equivalent"]


# ---------------------------------------------------------------- random objectives
@pytest.mark.parametrize("seed", [0, 1])
def test_every_scenario_claim_of_random_group_objectives_holds_on_the_compiled_loss(seed):
    """12 seeded draws per seed over group, batch and indicator constructs (tests/scenario_objectives.py;
    scripts/scenario_random.py runs 1,000 per seed): every checkable claim agrees with the loss."""
    checked = 0
    for text in draws(seed, 12):
        sc = scenario_analysis(dsl.parse(text, "rand.dsl"), 1.0, {"seq_len": 1}, check_loss=True)
        for s in (sc or {"scenarios": []})["scenarios"]:
            assert s["loss_check"]["status"] in ("agrees", "not checked"), (text, s["name"], s["loss_check"])
            checked += s["loss_check"]["status"] == "agrees"
    assert checked >= 30


def test_the_scenarios_are_the_same_on_every_run(dapo_zv):
    one = json.dumps(to_json(analyze(dapo_zv))["scenarios"], sort_keys=True)
    assert one == json.dumps(to_json(analyze(dapo_zv))["scenarios"], sort_keys=True)
