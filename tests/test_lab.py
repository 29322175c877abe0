"""drpo-lab: the synthetic task, the result rules, and one real run through drpo-train."""
import json
import math
import os
import subprocess
import sys

import pytest

from openrlhf_drpo import lab, labtask, toytask


@pytest.mark.parametrize("response, reward", [("", 0), ("w0 w1 w2", 0), ("w127 w127 w127 w127", 1 / 8),
                                              ("w112 w113 w127 w0 w113", 3 / 8),
                                              (" ".join(f"w{i}" for i in range(112, 120)), 1.0)])
def test_the_reward_counts_distinct_target_words_over_eight(response, reward):
    out = labtask.reward_func([f"w1 w2{response and ' ' + response}"], ["w1 w2"], [""])
    assert math.isclose(out["rewards"][0].item(), reward, rel_tol=1e-6)     # float32 tensors
    words = response.split()
    assert math.isclose(out["extra_logs"]["target_fraction"][0].item(),
                        sum(w in labtask.TARGETS for w in words) / len(words) if words else 0.0, rel_tol=1e-6)


def test_the_pre_training_distribution_is_zipf_with_sixteen_rare_targets():
    p = dict(zip(labtask.WORDS, labtask.word_distribution()))
    assert math.isclose(sum(p.values()), 1.0) and len(labtask.TARGETS) == 16
    assert all(p[w] == 0.0025 for w in labtask.TARGETS)
    common = [p[w] for w in labtask.WORDS if w not in labtask.TARGETS]
    assert common == sorted(common, reverse=True) and common[0] / common[1] == pytest.approx(2 ** 1.1)


def _steps(rewards, fractions):
    return [{"step": i + 1, "reward": r, "target_fraction": f} for i, (r, f) in enumerate(zip(rewards, fractions))]


@pytest.mark.parametrize("rewards, fractions, expected", [
    ([0.3] * 3 + [0.125] * 5, [0.4] * 3 + [0.9] * 5, True),      # mostly target words, one or two distinct
    ([0.3] * 3 + [0.25] * 5, [0.4] * 3 + [0.5] * 5, True),
    ([0.6] * 8, [0.9] * 8, False),                               # many distinct targets: learning
    ([0.05] * 8, [0.05] * 8, False),                             # never found the targets: not a collapse
    ([0.2] * 8, [0.45] * 8, False),
    ([], [], False),
])
def test_the_collapse_rule(rewards, fractions, expected):
    assert lab.collapsed(_steps(rewards, fractions)) is expected


def test_a_run_is_summarized_from_its_step_and_update_logs():
    steps = _steps([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [0.2] * 7)
    updates = [{"step": s, "update": u, "grad_norm": float(s * 10 + u), "max_token_weight": 1.0 + u,
                "ratio_min": 0.5, "ratio_max": 2.0, "dead": s == 3} for s in range(1, 8) for u in range(2)]
    updates[0]["grad_norm"] = float("nan")
    row = lab.summarize(steps, updates)
    assert row["final_reward"] == pytest.approx(0.5) and row["reward_auc"] == pytest.approx(0.4)
    assert row["max_grad_norm"] == 71.0 and row["max_token_weight"] == 2.0
    assert row["dead_steps"] == 1 and row["collapsed"] is False
    c = lab.curves(steps, updates)
    assert c["grad_norm"] == [11.0, 21.0, 31.0, 41.0, 51.0, 61.0, 71.0]
    assert c["mismatch"] == [pytest.approx(math.log(2))] * 7


@pytest.mark.parametrize("text, expected", [("drpo", ("drpo", {})), ("drpo:delta=0.2", ("drpo", {"delta": "0.2"})),
                                            ("spo:ε=0.2,", ("spo", {"ε": "0.2"})),
                                            ("x.dsl:a=1,b=2", ("x.dsl", {"a": "1", "b": "2"}))])
def test_objective_specs_parse(text, expected):
    assert lab.parse_spec(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["drpo:delta"], "expected OBJECTIVE or OBJECTIVE:NAME=VALUE"),
    (["drpo", "--updates", "5"], "--updates must divide 32"),
    (["drpo", "--updates", "-4"], "--updates must divide 32"),
    (["drpo", "--updates", "0"], "--updates must divide 32"),
    (["drpo", "--lr", "0"], "--lr be positive"),
    (["drpo:foo=1"], "unknown parameter 'foo' for objective 'drpo'"),
    (["nonexistent"], "no objective file or shipped objective named 'nonexistent'"),
])
def test_bad_input_stops_the_lab_before_anything_runs(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.lab", *argv, "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_the_lab_runs_an_objective_through_drpo_train_and_reports_what_it_measured(tmp_path):
    out, steps, updates = tmp_path / "lab", 3, 8
    # micro-batches of 2 (a drpo-train flag after --): 2 per optimizer step, still one row per step
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.lab", "drpo:delta=0.2", "--preset", "mild",
                           "--steps", str(steps), "--pretrain-steps", "20", "--out", str(out),
                           "--", "--train.micro_batch_size", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "predicted (drpo-analyze)" in proc.stdout and "binary-tv" in proc.stdout and "measured" in proc.stdout
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 1 and tuple(rows[0]) == lab.RESULT_KEYS
    row = rows[0]
    assert row["objective"] == "drpo delta=0.2" and row["params"] == {"delta": "0.2"} and row["preset"] == "mild"
    assert 0 <= row["final_reward"] <= 1 and row["max_grad_norm"] > 0 and row["max_token_weight"] > 0
    assert isinstance(row["collapsed"], bool) and row["dead_steps"] in range(steps + 1) and row["wall_s"] > 0
    assert (out / "results.md").read_text().startswith("| objective |")
    assert (out / "curves.png").stat().st_size > 10_000
    run = out / "runs" / "drpo-delta0.2-s0"
    log = toytask.steps_from_log((run / "train.log").read_text())
    per_update = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [(u["step"], u["update"]) for u in per_update] == [(s, u) for s in range(1, steps + 1) for u in range(updates)]
    assert all(u["ratio_min"] <= u["ratio_max"] and u["grad_norm"] > 0 for u in per_update)
    for s in log:       # the logged ratio max is the step's true maximum, not a mean over updates
        assert s["drpo_ratio_max"] == pytest.approx(max(u["ratio_max"] for u in per_update if u["step"] == s["step"]))
        assert s["actor_grad_norm"] == pytest.approx([u["grad_norm"] for u in per_update if u["step"] == s["step"]][-1])
    assert "ppo_kl is OpenRLHF's drift" in (run / "train.log").read_text()
