"""drpo-lab: the synthetic task, the result rules, and one real run through drpo-train."""
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

import dsl

from openrlhf_drpo.lab import driver as lab, results as lab_results, task as labtask, toytask


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
    assert lab_results.collapsed(_steps(rewards, fractions)) is expected


def test_a_run_is_summarized_from_its_step_and_update_logs():
    steps = _steps([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [0.2] * 7)
    for i, s in enumerate(steps):      # OpenRLHF's own step metrics
        s.update({"entropy_loss": 2.0 - 0.1 * i, "rollout/response_length_mean": 8.0 - (i == 0),
                  "rollout/truncated_rate": 1.0 - 0.5 * (i == 0)})
    # update 0: 10 tokens, 2 past the boundary, r = 1 each (ESS 1); update 1: r = 1 on 3 tokens, 3 on 1
    # (ESS (3 + 3)² / (4 * (3 + 9)) = 0.75), 1 past the boundary
    updates = [{"step": s, "update": u, "grad_norm": float(s * 10 + u), "max_token_weight": 1.0 + u,
                "ratio_min": 0.5, "ratio_max": 2.0, "dead": s == 3,
                **({"tokens": 10, "past_boundary": 2, "ratio_sum": 10.0, "ratio_sq_sum": 10.0} if u == 0 else
                   {"tokens": 4, "past_boundary": 1, "ratio_sum": 6.0, "ratio_sq_sum": 12.0})}
               for s in range(1, 8) for u in range(2)]
    updates[0]["grad_norm"] = float("nan")
    row = lab_results.summarize(steps, updates)
    assert row["final_reward"] == pytest.approx(0.5) and row["reward_auc"] == pytest.approx(0.4)
    assert row["max_grad_norm"] == 71.0 and row["max_abs_wr"] == 2.0
    assert row["dead_steps"] == 1 and row["collapsed"] is False
    assert row["entropy_drift"] == pytest.approx(-0.4) and row["final_entropy"] == pytest.approx(1.6)
    assert row["past_boundary"] == pytest.approx(3 / 14) and row["ess"] == pytest.approx(0.75)
    assert row["response_length"] == pytest.approx(8 - 1 / 7) and row["truncated"] == pytest.approx(1 - 0.5 / 7)
    c = lab_results.curves(steps, updates)
    assert c["grad_norm"] == [11.0, 21.0, 31.0, 41.0, 51.0, 61.0, 71.0]
    assert c["mismatch"] == [pytest.approx(math.log(2))] * 7
    assert c["entropy"][:2] == [2.0, 1.9] and c["ess"] == [0.75] * 7


@pytest.mark.parametrize("ratios, expected", [
    ([1.0] * 5, 1.0),                       # on-policy: every token counts
    ([1.0, 0.0, 0.0, 0.0], 0.25),           # one token holds all the weight: 1/n
    ([2.0, 2.0, 0.5, 0.5], 6.25 / 8.5),     # (Σr)² / (n Σr²) = 25 / (4 * 8.5)
])
def test_the_ess_of_the_ratios_is_normalized_by_the_token_count(ratios, expected):
    assert lab_results.ess(sum(ratios), sum(r * r for r in ratios), len(ratios)) == pytest.approx(expected)
    assert lab_results.ess(0.0, 0.0, 0) is None


@pytest.mark.parametrize("values, expected", [
    ([2.0, 1.9, 1.8, 1.7], -0.2),                        # the last steps' mean (1.9, 1.8, 1.7) minus the first
    ([3.7, 1.8, 0.9, 0.2] + [0.0] * 16, -3.7),           # a collapse early in the run: the whole fall
    ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 4.0),          # the last 5 steps: 3..7, mean 5
    ([None, 1.0, float("nan"), 1.5, 2.0], 0.75),         # gaps left out: the first value, the mean of the rest
    ([1.0], None), ([], None),
])
def test_the_entropy_drift_is_the_final_entropy_minus_the_first_steps(values, expected):
    got = lab_results.drift(values)
    assert got == (None if expected is None else pytest.approx(expected))


def test_the_interval_is_students_t_over_the_seeds():
    # [1, 2, 3]: mean 2, s = 1, t(0.975, 2) = 4.302653: 2 +- 4.302653 / sqrt(3)
    cell = lab_results.interval([1.0, 2.0, 3.0])
    assert cell["mean"] == 2.0 and cell["ci95"] == pytest.approx([2 - 2.484138, 2 + 2.484138], abs=1e-6)
    # [0.5, 0.7]: mean 0.6, s = 0.141421, t(0.975, 1) = 12.706205: 0.6 +- 1.270620
    assert lab_results.interval([0.5, 0.7])["ci95"] == pytest.approx([0.6 - 1.270620, 0.6 + 1.270620], abs=1e-6)
    assert lab_results.interval([4.0, 4.0, 4.0]) == {"mean": 4.0, "ci95": [4.0, 4.0]}
    assert lab_results.interval([0.3]) == {"mean": 0.3, "ci95": None}                # one seed: no interval
    assert lab_results.interval([None, float("nan")]) == {"mean": None, "ci95": None}
    assert lab_results.interval([1.0, None, 3.0])["mean"] == 2.0                      # what was not measured is left out


def test_the_4_bit_engine_rounds_each_group_of_32_weights_to_16_levels():
    import torch
    from openrlhf_drpo.lab.pipe import int4_weights
    g = torch.Generator().manual_seed(0)
    weights = {"m.weight": (torch.randn(4, 64, generator=g) * 0.02).to(torch.bfloat16),
               "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16)}
    out = int4_weights(weights)
    assert out["m.weight"].dtype == torch.bfloat16 and torch.equal(out["norm.weight"], weights["norm.weight"])
    for row, q in zip(weights["m.weight"].float().view(-1, 32), out["m.weight"].float().view(-1, 32)):
        scale = row.abs().max() / 7
        levels = q / scale       # k * scale for k in -8..7, up to bf16's rounding of the result
        assert torch.allclose(levels, levels.round(), atol=0.05) and levels.round().abs().max() <= 8
        assert (q - row).abs().max() <= scale / 2 + 0.01 * row.abs().max()
    assert not torch.equal(out["m.weight"], weights["m.weight"])


def test_a_samples_seed_is_fixed_by_what_is_sampled():
    from openrlhf_drpo.lab.pipe import sample_seed
    seeds = {sample_seed(b, p, o, i) for b in (0, 1) for p in ("w1 w2", "w2 w1") for o in (0, 1) for i in range(4)}
    assert len(seeds) == 32 and sample_seed(3, "w1", 0, 2) == sample_seed(3, "w1", 0, 2)


def _row(objective, seed, final, collapsed=False):
    return {"objective": objective, "params": {}, "seed": seed, "preset": "mild", "final_reward": final,
            "reward_auc": final / 2, "max_grad_norm": 1.0 + seed, "max_abs_wr": 2.0, "mismatch": 0.01,
            "entropy_drift": -0.1, "final_entropy": 2.0, "past_boundary": 0.05, "ess": 0.9, "response_length": 8.0,
            "truncated": 1.0, "collapsed": collapsed, "dead_steps": 0, "wall_s": 1.0}


def test_seeds_are_aggregated_per_objective_and_ranked_by_mean_with_the_overlaps_marked():
    rows = [_row("a", 0, 0.70), _row("a", 1, 0.72), _row("a", 2, 0.74),        # a: 0.72 [0.670, 0.770]
            _row("b", 0, 0.60), _row("b", 1, 0.70), _row("b", 2, 0.80),        # b: 0.70, overlaps a
            _row("c", 0, 0.10, True), _row("c", 1, 0.12, True), _row("c", 2, 0.14)]   # c: 0.12, below both
    summary = lab_results.aggregate(rows)
    assert [s["objective"] for s in summary] == ["a", "b", "c"] and [s["seeds"] for s in summary] == [3, 3, 3]
    a = summary[0]
    assert a["final_reward"]["mean"] == pytest.approx(0.72)
    assert a["final_reward"]["ci95"] == pytest.approx([0.72 - 4.302653 * 0.02 / 3 ** 0.5,
                                                       0.72 + 4.302653 * 0.02 / 3 ** 0.5], abs=1e-6)
    assert a["max_grad_norm"]["mean"] == 2.0 and summary[2]["collapsed"] == "2 of 3"
    assert summary[1]["final_reward"]["ci95"][1] == pytest.approx(0.70 + 4.302653 * 0.1 / 3 ** 0.5)
    assert [(s["rank"], s["tied_with"]) for s in summary] == [(1, ["b"]), (2, ["a"]), (3, [])]
    table = lab_results.summary_table(summary)
    assert "| 1 (=2) | a | 3 | 0.72 [0.67, 0.77]" in table and "| 3 | c | 3 |" in table and "2 of 3" in table
    assert "max \\|w·r\\|" in table and "max_token_weight" not in table    # the measured |w·r|, not "w"


# docs/lab.md's stress study (final reward, recorded): the old rule (1 + the intervals wholly above)
# ranked DRPO δ = 0.2 (0.508) first, above DPPO (0.545), second
STRESS = [(0.683, 0.655, 0.71), (0.508, 0.344, 0.673), (0.545, 0.461, 0.629), (0.207, 0, 0.561), (0.167, 0, 0.346),
          (0.127, 0.118, 0.136)]


@pytest.mark.parametrize("cells, expected", [
    ([(0.9, 0.8, 1.0), (0.5, 0.4, 0.6), (0.1, 0.0, 0.2)], [(1, []), (2, []), (3, [])]),       # all separated
    ([(0.9, 0.5, 1.3), (0.5, 0.4, 0.6), (0.1, 0.0, 0.45)], [(1, [1]), (2, [0, 2]), (3, [1])]),
    (STRESS, [(1, [1]), (3, [0, 2, 3, 4]), (2, [1, 3]), (4, [1, 2, 4, 5]), (5, [1, 3, 5]), (6, [3, 4])]),
    ([(0.1, 0.0, 0.2), (0.9, 0.8, 1.0)], [(2, []), (1, [])]),                          # ranked by mean, not by order
    ([(0.5, None, None), (0.5, None, None), (0.4, None, None)], [(1, [1]), (1, [0]), (3, [])]),   # equal means share
])
def test_a_rank_follows_the_mean_and_lists_the_overlapping_intervals(cells, expected):
    cells = [{"mean": m, "ci95": None if lo is None else [lo, hi]} for m, lo, hi in cells]
    assert lab_results.ranks(cells) == expected
    ranked = sorted((r, -c["mean"]) for (r, _), c in zip(expected, cells))
    assert ranked == sorted(ranked, key=lambda x: x[1])       # a higher mean never ranks below a lower one


def test_under_random_reward_the_drift_closest_to_zero_ranks_first():
    rows = [{**_row(name, seed, 0.5), "preset": "random-reward", "entropy_drift": d}
            for name, drifts in (("up", [0.30, 0.35, 0.40]), ("flat", [-0.02, 0.0, 0.03]), ("down", [-0.2, -0.25, -0.3]))
            for seed, d in enumerate(drifts)]
    summary = lab_results.aggregate(rows)
    assert [(s["objective"], s["rank"]) for s in summary] == [("up", 3), ("flat", 1), ("down", 2)]
    assert "|entropy drift|, smallest first" in lab_results.rank_rule("random-reward")


@pytest.mark.parametrize("text, expected", [("drpo", ("drpo", {})), ("drpo:delta=0.2", ("drpo", {"delta": "0.2"})),
                                            ("spo:ε=0.2,", ("spo", {"ε": "0.2"})),
                                            ("x.dsl:a=1,b=2", ("x.dsl", {"a": "1", "b": "2"}))])
def test_objective_specs_parse(text, expected):
    assert dsl.parse_spec(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["drpo:delta"], "expected NAME=VALUE after 'drpo:', got 'delta'"),
    (["drpo", "--updates", "5"], "--updates must divide 32"),
    (["drpo", "--updates", "-4"], "--updates must divide 32"),
    (["drpo", "--updates", "0"], "--updates must divide 32"),
    (["drpo", "--lr", "0"], "--lr be positive"),
    (["drpo", "--parallel", "0"], "--stale-k and --parallel must be at least 1"),
    (["drpo", "--stale-k", "0"], "--stale-k and --parallel must be at least 1"),
    (["drpo:foo=1"], "unknown parameter 'foo' for objective 'drpo'"),
    (["nonexistent"], "no objective file or shipped objective named 'nonexistent'"),
    # one the pipeline cannot train: test_one_objective_drpo_train_refuses_stops_the_lab_and_the_cpu_mode_line_is_said_once
])
def test_bad_input_stops_the_lab_before_anything_runs(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.lab", *argv, "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def task_cache(tmp_path_factory):
    """The built task's cache for this module's labs: a tmp dir, built by the first lab, reused by the rest."""
    return tmp_path_factory.mktemp("task-cache")


def _labs(cache, *labs):
    """drpo-labs run side by side (a small task, 2-4 steps), each (out, argv); their stdouts and results.json."""
    procs = []
    env = {**os.environ, labtask.CACHE_ENV: str(cache)}
    for out, argv in labs:
        cut = argv.index("--") if "--" in argv else len(argv)      # drpo-train's flags go last
        procs.append(subprocess.Popen([sys.executable, "-m", "openrlhf_drpo.lab", *argv[:cut], "--pretrain-steps",
                                       "20", "--out", str(out), *argv[cut:]],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    done = [p.communicate(timeout=900) for p in procs]
    for p, (stdout, stderr) in zip(procs, done):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return [(stdout, json.loads((out / "results.json").read_text())) for (out, _), (stdout, _) in zip(labs, done)]


def _lab(cache, out, *argv):
    return _labs(cache, (out, list(argv)))[0]


# Three labs serve the pipeline tests, two launches at a time: each costs a start-up (Ray, vLLM, DeepSpeed),
# a run in a started pipeline a few seconds of training.
AGAIN = "drpo_again"        # drpo.dsl's text under another name: the same run, trained after two others


@pytest.fixture(scope="module")
def shared(tmp_path_factory, task_cache):
    """3 objectives x 2 seeds on 2 pipelines side by side, micro-batches of 2 (a drpo-train flag after --),
    dealt round-robin: each pipeline trains drpo delta=0.2, then ppo, then AGAIN (drpo's text) on its seed."""
    out = tmp_path_factory.mktemp("shared") / "lab"
    again = out.parent / f"{AGAIN}.dsl"
    again.write_text((dsl.library.folder() / "drpo.dsl").read_text(encoding="utf-8"), encoding="utf-8")    # what "drpo" loads
    return out, *_lab(task_cache, out, "drpo:delta=0.2", "ppo", f"{again}:delta=0.2", "--seeds", "2", "--steps", "3",
                      "--parallel", "2", "--", "--train.micro_batch_size", "2")


@pytest.fixture(scope="module")
def mismatch_and_coin(tmp_path_factory, task_cache, shared):
    """Two labs side by side (one pipeline each), after `shared` built the task: the mismatch preset
    (4-bit engine) with the engine synced every 2 steps, and the random-reward preset."""
    mismatch, coin = tmp_path_factory.mktemp("mismatch") / "lab", tmp_path_factory.mktemp("coin") / "lab"
    m, c = _labs(task_cache, (mismatch, ["drpo:delta=0.2", "--seeds", "1", "--steps", "4", "--preset", "mismatch",
                                         "--stale-k", "2"]),
                 (coin, ["grpo_clip_higher", "--seeds", "1", "--steps", "2", "--preset", "random-reward"]))
    return (mismatch, *m), (coin, *c)


def _metrics(out, run):
    return [json.loads(x) for x in (out / "runs" / run / "metrics.jsonl").read_text().splitlines()
            if "step" in json.loads(x)]


def test_the_lab_trains_every_run_on_shared_pipelines_and_reports_what_it_measured(shared, task_cache):
    out, stdout, found = shared         # `found`: results.json (`results` is the module)
    steps, updates = 3, 8
    objectives = ["drpo delta=0.2", "ppo", f"{out.parent / AGAIN}.dsl delta=0.2"]
    assert "predicted (drpo-analyze)" in stdout and "binary-tv" in stdout and "measured" in stdout
    # a line per finished run, with the runs done so far and the time left
    finished = re.findall(r"^\[(\d)/6\] .*: done, final step's reward [\d.]+; (\d) of 6 runs done, about \d+ min left$",
                          stdout, re.M)
    assert sorted(i for i, _ in finished) == sorted(k for _, k in finished) == ["1", "2", "3", "4", "5", "6"], stdout
    rows, summary = found["runs"], found["summary"]
    assert [(r["objective"], r["seed"]) for r in rows] == [(o, seed) for o in objectives for seed in (0, 1)]
    assert all(tuple(r) == lab_results.RESULT_KEYS and r["preset"] == "mild" for r in rows)
    for r in rows:
        assert 0 <= r["final_reward"] <= 1 and r["max_grad_norm"] > 0 and r["max_abs_wr"] > 0
        assert r["mismatch"] > 0 and isinstance(r["collapsed"], bool) and r["dead_steps"] in range(steps + 1)
        assert r["wall_s"] > 0 and 0 < r["final_entropy"] < math.log(132) and r["entropy_drift"] is not None
        assert 0 <= r["past_boundary"] <= 1 and 0 < r["ess"] <= 1
        # the task's responses run to the 8-word limit (its model hardly ever stops): OpenRLHF counts them truncated
        assert 7 <= r["response_length"] <= 8 and 0.8 <= r["truncated"] <= 1
    assert [s["objective"] for s in summary] == objectives and all(s["seeds"] == 2 for s in summary)
    for s in summary:
        mine = [r["final_reward"] for r in rows if r["objective"] == s["objective"]]
        assert s["final_reward"] == lab_results.interval(mine, lab_results.RANGES["final_reward"]) and s["collapsed"].endswith(" of 2") and s["rank"] in (1, 2, 3)
    md = (out / "results.md").read_text()
    assert md.startswith(f"# drpo-lab: {', '.join(objectives)} under mild\n\nPreset `mild`: 8 updates per rollout")
    assert "Rank: by the mean final reward" in md and "## Predicted (drpo-analyze)" in md
    assert "rank: by the mean final reward" in stdout        # the rule beside the console's table too
    assert "| drpo delta=0.2 |" in md.split("## Predicted")[1]
    assert (out / "results.html").read_text().count("<table>") == 3     # the tables and the curves, in one file
    assert "predicted (drpo-analyze)" in stdout and "wrote " + str(out) + "/results.json, results.md, results.html" in stdout
    assert len(re.findall(r"^openrlhf-drpo: (?:CPU|GPU) mode", stdout, re.M)) == 1
    assert re.search(r"^the task .*: (built|reused), " + re.escape(str(task_cache)), stdout, re.M) and \
        not (out / "task").exists()      # in the cache, not in --out
    assert (out / "curves.png").stat().st_size > 10_000
    # runs dealt round-robin: each pipeline trained its three runs one after the other
    for p, seed in (("p0", 0), ("p1", 1)):
        runs = [f"drpo-delta0.2-s{seed}", f"ppo-s{seed}", f"{AGAIN}-delta0.2-s{seed}"]
        log = (out / "pipelines" / p / "pipeline.log").read_text()
        assert [log.count(f"drpo-lab: run {k} started") for k in range(4)] == [1, 1, 1, 0]
        assert [r["metrics"] for r in json.loads((out / "pipelines" / p / "lab.json").read_text())["runs"]] == \
            [str(out / "runs" / run / "metrics.jsonl") for run in runs]
    run = "drpo-delta0.2-s1"
    log = _metrics(out, run)
    per_update = [json.loads(line) for line in (out / "runs" / run / "steps.jsonl").read_text().splitlines()]
    assert [(u["step"], u["update"]) for u in per_update] == [(s, u) for s in range(1, steps + 1) for u in range(updates)]
    assert all(u["ratio_min"] <= u["ratio_max"] and u["grad_norm"] > 0 for u in per_update)
    for u in per_update:     # each update's sums: its tokens (8 each), those past the boundary, Σr and Σr²
        assert 0 < u["tokens"] <= 8 * 32 // updates and 0 <= u["past_boundary"] <= u["tokens"]
        assert u["ratio_sum"] ** 2 <= u["tokens"] * u["ratio_sq_sum"] * (1 + 1e-9)      # Cauchy-Schwarz: ESS <= 1
    for s in log:       # the logged ratio max is the step's true maximum, not a mean over updates
        assert s["drpo_ratio_max"] == pytest.approx(max(u["ratio_max"] for u in per_update if u["step"] == s["step"]))
        assert s["actor_grad_norm"] == pytest.approx([u["grad_norm"] for u in per_update if u["step"] == s["step"]][-1])
        assert s["engine_weights"] == s["step"]       # mild: the engine gets the weights after every step


def test_a_run_in_a_shared_pipeline_gives_the_same_steps_as_alone(shared):
    # drpo's text trained third in its pipeline (after drpo and ppo seed 0 trained there) against the
    # same run trained first, when nothing had trained in the pipeline: as in a pipeline of its own
    inside, by_itself = _metrics(shared[0], f"{AGAIN}-delta0.2-s0"), _metrics(shared[0], "drpo-delta0.2-s0")
    assert [s["step"] for s in inside] == [s["step"] for s in by_itself] == [1, 2, 3]
    assert [s["reward"] for s in inside] == [s["reward"] for s in by_itself]
    # the same samples, but not always the same bf16 trainer bit for bit on a loaded CPU: in 2 runs
    # of about 10 its forward differed from step 1 (entropy 0.03%, vllm_kl 0.15%, grad norm 0.24%,
    # ratio max 0.03%), and the runs then drifted a little (by step 3: ratio max 2%, policy loss
    # 8e-4 apart). The rewards, which follow the engine's weights step by step, are equal (above).
    for key, tolerance in (("actor_grad_norm", dict(rel=2e-2)), ("policy_loss", dict(abs=2e-3))):
        assert [s[key] for s in inside] == pytest.approx([s[key] for s in by_itself], **tolerance), key
    assert inside[0]["drpo_ratio_max"] == pytest.approx(by_itself[0]["drpo_ratio_max"], rel=1e-2)
    # and the other seed is another run
    assert [s["reward"] for s in _metrics(shared[0], "drpo-delta0.2-s1")] != [s["reward"] for s in inside]


def test_the_stale_and_mismatch_settings_show_in_the_step_log(shared, mismatch_and_coin):
    (out, stdout, found), _ = mismatch_and_coin
    log = _metrics(out, "drpo-delta0.2-s0")
    assert [s["engine_weights"] for s in log] == [0, 2, 2, 4]     # weights reach the engine after steps 2 and 4
    updates = [json.loads(x) for x in (out / "runs" / "drpo-delta0.2-s0" / "steps.jsonl").read_text().splitlines()]
    c = lab_results.curves(log, updates)
    # rollouts of steps 1 and 3 come from the trainer's current weights, those of 2 and 4 from one step before
    fresh = [m for m, s in zip(c["mismatch"], c["step"]) if s in (1, 3)]
    stale = [m for m, s in zip(c["mismatch"], c["step"]) if s in (2, 4)]
    mild = shared[2]["runs"][0]["mismatch"]      # drpo delta=0.2 seed 0 under the mild preset
    assert min(fresh) >= 3 * mild, (fresh, stale, mild)
    # a stale rollout adds a step of the trainer's drift to the 4-bit engine's (measured: fresh
    # 0.068 and 0.097, stale 0.80 and 2.86)
    assert min(stale) > 2 * max(fresh), (fresh, stale, mild)
    assert found["runs"][0]["preset"] == "mismatch" and "4-bit weights" in stdout


@pytest.mark.parametrize("key, values, cut", [
    ("max_grad_norm", [1.0, 2.0, 90.0], (0.0, None)),      # a spike in one seed: t reaches below 0
    ("final_reward", [0.2, 0.95, 1.0], (0.0, 1.0)),        # both ends past [0, 1]
    ("mismatch", [0.10, 0.11, 0.12], (None, None)),        # inside the range: Student's t as it is
])
def test_an_interval_is_cut_to_what_the_measure_can_be(key, values, cut):
    rows = [{**_row("a", i, 0.5), key: v} for i, v in enumerate(values)]
    half = 4.302653 * statistics.stdev(values) / 3 ** 0.5
    t = [statistics.mean(values) - half, statistics.mean(values) + half]
    expected = [t[0] if cut[0] is None else cut[0], t[1] if cut[1] is None else cut[1]]
    assert lab_results.aggregate(rows)[0][key]["ci95"] == pytest.approx(expected, rel=1e-6)


PREDICTED = (["objective", "w range", "warnings"], [["grpo_clip_higher", "{0, 1}", ""], ["b<", "[0.9, 1.1]", "w|x"]])


def test_results_md_holds_the_title_setting_rule_definitions_and_both_tables():
    rows = [_row("a", 0, 0.70), _row("a", 1, 0.74), _row("b<", 0, 0.10)]
    page = lab_results.markdown(rows, lab_results.aggregate(rows), "drpo-lab: a, b< under mild",
                                "Preset `mild`: 8 updates per rollout.", PREDICTED)
    assert page.startswith("# drpo-lab: a, b< under mild\n\nPreset `mild`: 8 updates per rollout.\n")
    assert "Rank: by the mean final reward, highest first" in page and "(Σr)²/(n·Σr²)" in page
    assert "## Predicted (drpo-analyze)\n\n| objective | w range | warnings |" in page
    assert "| grpo_clip_higher | {0, 1} |" in page and "| w\\|x |" in page
    assert page.index("## Measured") < page.index("## Predicted") < page.index("## Every run")


def test_the_html_page_holds_the_tables_the_rule_and_the_curves():
    rows = [_row("a", 0, 0.70), _row("a", 1, 0.74), _row("b<", 0, 0.10)]
    summary = lab_results.aggregate(rows)
    md = lab_results.markdown(rows, summary, "drpo-lab: a, b< under mild", "Preset `mild`.", PREDICTED)
    page = lab_results.html_page(md, b"\x89PNG fake")
    tables = re.findall(r"<table>(.*?)</table>", page)
    assert len(tables) == 3 and tables[0].count("<tr>") == 1 + 2 and tables[2].count("<tr>") == 1 + 3
    assert "<th>rank</th><th>objective</th>" in tables[0] and "<td>b&lt;</td>" in tables[0]
    assert "<td>0.72 [0.466, 0.974]</td>" in tables[0] and "<th>max |w·r|</th>" in tables[0]
    assert "<td>grpo_clip_higher</td>" in tables[1] and "<td>w|x</td>" in tables[1]     # the predicted table
    assert "Rank: by the mean final reward" in page and "<h2>Predicted (drpo-analyze)</h2>" in page
    assert 'src="data:image/png;base64,iVBORyBmYWtl"' in page and "<title>drpo-lab: a, b&lt; under mild</title>" in page


def test_the_random_reward_is_a_fair_coin_fixed_by_the_samples_key():
    from openrlhf_drpo.lab.pipe import random_reward, sample_seed
    keys = [(b, f"w{p} w1", o, i) for b in range(3) for p in range(20) for o in range(2) for i in range(4)]
    coins = [random_reward(*k) for k in keys]
    assert set(coins) == {0.0, 1.0} and abs(sum(coins) / len(coins) - 0.5) < 0.1      # 480 flips
    assert coins == [random_reward(*k) for k in keys]           # the same on every rerun
    # a hash of its own: not a function of the sampling seed the engine draws the tokens from
    assert len({(sample_seed(*k) % 2, c) for k, c in zip(keys, coins)}) == 4


def test_the_task_is_built_once_per_settings_and_reused(tmp_path, monkeypatch):
    built = []

    def build(folder, pretrain_steps):      # the real build pre-trains for seconds: only where it writes counts here
        built.append(pretrain_steps)
        os.makedirs(os.path.join(folder, "model"))
        return {"target_probability": [0.0025]}
    monkeypatch.setenv(labtask.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(labtask, "build", build)
    first, reused_first = labtask.cached(pretrain_steps=20)
    again, reused_again = labtask.cached(pretrain_steps=20)
    other, _ = labtask.cached(pretrain_steps=30)
    assert built == [20, 30] and (reused_first, reused_again) == (False, True) and again == first
    assert first["model"].startswith(str(tmp_path)) and other["model"] != first["model"]
    assert first["target_probability"] == [0.0025] and not list(tmp_path.glob("lab-task-building-*"))


def test_the_lab_flags_have_help_and_the_presets_include_random_reward():
    text = lab.parser().format_help()
    for flag, words in (("--seeds", "runs per objective"), ("--steps", "rollouts"), ("--out", "results.html")):
        assert re.search(rf"{flag} \S+\s+[^-]*{words}", text), (flag, text)
    assert "random-reward" in text and lab.PRESETS["random-reward"]["random_reward"] is True


def test_the_predicted_table_never_wraps_a_name_inside_a_word():
    from openrlhf_drpo.lab.driver import analysis_lines
    text, (head, rows) = analysis_lines([("grpo_clip_higher", {}), ("drpo", {"delta": "0.2"})])
    assert "grpo_clip_higher " in text and "grpo_clip_highe\n" not in text and "\nr " not in text
    assert [r[0] for r in rows] == ["grpo_clip_higher", "drpo delta=0.2"] and head[0] == "objective"


def test_one_objective_drpo_train_refuses_stops_the_lab_and_the_cpu_mode_line_is_said_once(tmp_path):
    # one lab run for both (it loads OpenRLHF to refuse as drpo-train does: half a minute on 2 cores):
    # the objective the pipeline cannot train is refused as drpo-train refuses it, before the task
    # and Ray, and the CPU mode line comes once for all four objectives
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.lab", "drpo", "ppo", "drpo:delta=0.2", "grpo_k3",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "drpo-lab: error: drpo-train refuses it: objective 'grpo_k3' uses π_ref, but " \
        "OpenRLHF passes" in proc.stderr + proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
    assert len(re.findall(r"^openrlhf-drpo: (?:CPU|GPU) mode", proc.stdout, re.M)) == 1, proc.stdout


def test_random_reward_pays_a_coin_flip_and_the_task_is_reused(mismatch_and_coin):
    (_, mismatch_stdout, _), (out, stdout, found) = mismatch_and_coin
    log = _metrics(out, "grpo_clip_higher-s0")
    # the task's own reward starts near 0 (16 rare targets); coin flips over 32 samples: near 1/2, in 32nds
    assert all(0.2 < s["reward"] < 0.8 and (s["reward"] * 32) == pytest.approx(round(s["reward"] * 32)) for s in log)
    assert all(s["target_fraction"] < 0.2 for s in log)       # what the policy writes: still the task's
    assert found["runs"][0]["preset"] == "random-reward" and found["summary"][0]["rank"] == 1
    assert "|entropy drift|, smallest first" in stdout
    for text in (stdout, mismatch_stdout):        # the first lab (`shared`) built the task, these reused it
        assert re.search(r"^the task .*: reused, ", text, re.M), text[:2000]


def test_the_clipped_tokens_and_ratio_sums_the_lab_logs_match_ppos_definition():
    # oracle independent of the core: PPO's clip stops a token's gradient where A > 0 and r > 1 + ε,
    # or A < 0 and r < 1 − ε (ε = 0.2); A = 0 tokens are never past it; masked tokens count nowhere
    import torch
    from openrlhf_drpo import ObjectiveLoss
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 12, generator=g, dtype=torch.float64) * 3 - 0.05
    new = old + 0.4 * torch.randn(6, 12, generator=g, dtype=torch.float64)
    A = torch.randn(6, 12, generator=g, dtype=torch.float64)
    A[0, :4] = 0.0
    mask = torch.ones(6, 12, dtype=torch.bool)
    mask[1, 6:] = False
    loss_fn = ObjectiveLoss("ppo")
    loss_fn.track_extremes = True
    loss_fn(new, old, A, action_mask=mask)
    r = (new - old).exp()
    past = mask & (((A > 0) & (r > 1.2)) | ((A < 0) & (r < 0.8)))
    got = loss_fn.extremes
    assert got["tokens"] == int(mask.sum()) and got["past_boundary"] == int(past.sum()) > 0
    assert got["ratio_sum"] == pytest.approx(r[mask].sum().item()) and \
        got["ratio_sq_sum"] == pytest.approx((r[mask] ** 2).sum().item())
