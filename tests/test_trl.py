"""TRL's own GRPOTrainer is the oracle for openrlhf_drpo.trl: a shipped objective that writes
TRL's clipped surrogate logs, step by step, the loss and reward TRL's own loss logs, under each
normalization loss_type names; num_iterations = 2 so that π ≠ μ and the clip acts. Real runs on
CPU with a tiny Llama and tokenizer built here."""
import inspect
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from dsl import DslError, parse
from openrlhf_drpo.lab.toytask import SPECIAL, WORDS, tiny_llama
from openrlhf_drpo.trl import TRL_VERSION, ObjectiveGRPOTrainer, TrlObjectiveLoss

METRICS = ["drpo_w_mean", "drpo_past_boundary_diverging", "drpo_past_boundary_converging", "drpo_abs_pi_minus_mu",
           "drpo_ratio_max"]


GOOD = {"w4", "w5", "w6", "w7"}     # a quarter of the words: a random policy scores ~0.25, with spread


def reward(completions, **kwargs):
    return [sum(w in GOOD for w in c.split()) / max(len(c.split()), 1) for c in completions]


def run(tmp_path, objective=None, steps=4, lr=1e-2, **config):
    """log_history of a GRPO run: TRL's own loss (objective None) or ours."""
    model, _, model_dir = tiny_llama(str(tmp_path), SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)     # TRL loads it (and its reference model, where beta > 0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = Dataset.from_list([{"prompt": " ".join(WORDS[(3 * i + j) % 16] for j in range(4))} for i in range(64)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=steps, learning_rate=lr, logging_steps=1, report_to="none",
                      save_strategy="no", seed=0, data_seed=0, bf16=False, temperature=1.0, dataloader_num_workers=0,
                      **{"num_iterations": 2, "beta": 0.0, **config})
    kwargs = dict(model=model_dir, reward_funcs=reward, args=args, train_dataset=prompts, processing_class=tokenizer)
    if objective is None:
        trainer = GRPOTrainer(**kwargs)
    else:
        name, params = objective
        trainer = ObjectiveGRPOTrainer(objective=name, objective_params=params, **kwargs)
    torch.manual_seed(0)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_grpo_clip_higher_logs_trls_own_loss_and_reward_step_by_step(tmp_path, loss_type):
    theirs = run(tmp_path / "trl", loss_type=loss_type, epsilon=0.2, epsilon_high=0.28)
    ours = run(tmp_path / "ours", ("grpo_clip_higher", {"ε_low": 0.2, "ε_high": 0.28}), loss_type=loss_type)
    assert len(ours) == len(theirs) == 4
    # the clip acts: on the second pass over a generation π has moved away from μ
    assert any(h["drpo_past_boundary_diverging"] > 0 for h in ours) and any(h["loss"] != 0 for h in ours)
    for a, b in zip(ours, theirs):      # reward: logged on the steps that generate
        assert a.get("reward") == b.get("reward") and a.get("reward_std") == b.get("reward_std"), (a, b)
        for key in ("loss", "grad_norm", "entropy"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a, b)


def assert_same_log(ours, theirs):
    """ours logs what TRL logs, step by step: reward, loss, gradient norm and every metric TRL's
    loss term logs (policy_loss and entropy_coef with the entropy bonus, kl with beta)."""
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert a.get("reward") == b.get("reward") and a.get("reward_std") == b.get("reward_std"), (a, b)
        for key in ["loss", "grad_norm", "entropy"] + [k for k in ("policy_loss", "entropy_coef", "kl") if k in b]:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a, b)


# settings the cases above cannot tell apart: accumulation (policy_loss before its scaling, the
# normalizers' accumulation factor), the entropy bonus on the entropy mask, the off-policy mask
SETTINGS = [
    dict(loss_type="grpo", gradient_accumulation_steps=2),
    dict(loss_type="dapo", gradient_accumulation_steps=2),
    dict(loss_type="grpo", gradient_accumulation_steps=2, entropy_coef=0.05, beta=0.1),
    dict(loss_type="dapo", entropy_coef=0.05, top_entropy_quantile=0.5),
    dict(loss_type="bnpo", off_policy_mask_threshold=0.001),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_trls_settings_around_the_policy_term_keep_their_meaning(tmp_path, settings):
    theirs = run(tmp_path / "trl", steps=2, epsilon=0.2, epsilon_high=0.28, **settings)
    ours = run(tmp_path / "ours", ("grpo_clip_higher", {"ε_low": 0.2, "ε_high": 0.28}), steps=2, **settings)
    assert_same_log(ours, theirs)
    if "entropy_coef" in settings:
        assert all("policy_loss" in h and "entropy_coef" in h for h in ours)
    if "off_policy_mask_threshold" in settings:     # not vacuous: the mask changes TRL's own loss
        unmasked = run(tmp_path / "unmasked", steps=2, epsilon=0.2, epsilon_high=0.28, loss_type="bnpo")
        assert any(not math.isclose(a["loss"], b["loss"], rel_tol=1e-3) for a, b in zip(unmasked, theirs))


def test_luspo_with_grpo_normalization_is_trls_luspo(tmp_path):
    theirs = run(tmp_path / "trl", steps=2, loss_type="luspo", importance_sampling_level="sequence",
                 epsilon=2e-3, epsilon_high=2.5e-3)
    ours = run(tmp_path / "ours", ("luspo", {}), steps=2, loss_type="grpo")
    assert any(h["drpo_past_boundary_diverging"] > 0 for h in ours)
    assert_same_log(ours, theirs)


def test_another_clip_differs_from_trls(tmp_path):
    theirs = run(tmp_path / "trl", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    ours = run(tmp_path / "ours", ("grpo_clip_higher", {"ε_low": 0.2, "ε_high": 0.05}), loss_type="dapo")
    assert any(not math.isclose(a["loss"], b["loss"], rel_tol=1e-3) for a, b in zip(ours, theirs))


# TRL's β·k3 written in the objective: π_ref is TRL's ref_per_token_logps, and TRL's default bias
# correction (use_bias_correction_kl) multiplies k3 by the differentiable ratio r
GRPO_K3 = ("ε_low = 0.2\nε_high = 0.28\nβ = 0.1\nd = log(π_ref) - log(π)\n"
           "min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) - β*r*(exp(d) - d - 1)\n")


def test_trls_kl_term_keeps_its_meaning_and_the_same_kl_written_in_the_objective_equals_it(tmp_path):
    theirs = run(tmp_path / "trl", steps=2, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.1)
    ours = run(tmp_path / "ours", ("grpo_clip_higher", {}), steps=2, loss_type="dapo", beta=0.1)
    assert len(ours) == len(theirs) == 2 and all("kl" in h for h in theirs)
    assert_same_log(ours, theirs)       # kl among the keys compared, step by step
    # not vacuous: by the second step π has left the reference model, and the term weighs in
    assert theirs[0]["kl"] == 0 and theirs[1]["kl"] > 0, theirs
    assert 0.1 * theirs[-1]["kl"] > 1e-3 * abs(theirs[-1]["loss"]), theirs[-1]
    # beta > 0 loads the reference model; the objective's KL replaces TRL's term, not added twice
    written = run(tmp_path / "written", (parse(GRPO_K3, "grpo_k3.dsl"), {}), steps=2, loss_type="dapo", beta=0.1)
    assert_same_log(written, theirs)


def test_training_end_to_end_raises_the_reward_and_logs_our_metrics(tmp_path):
    log = run(tmp_path, ("drpo", {"delta": 0.2}), steps=16, lr=3e-2, loss_type="dapo")
    assert all(k in h for h in log for k in METRICS)
    rewards = [h["reward"] for h in log if "reward" in h]      # one per generation (num_iterations = 2)
    assert len(rewards) == 8 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards


@pytest.mark.parametrize("loss_type, shipped, normalization", [
    ("cispo", "cispo", "dapo"), ("sapo", "sapo", "grpo"), ("luspo", "luspo", "grpo"), ("vespo", "vespo", "dapo")])
def test_a_loss_type_that_is_a_formula_is_refused_naming_ours_and_trls_normalization(tmp_path, loss_type, shipped,
                                                                                       normalization):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type=loss_type, report_to="none")
    with pytest.raises(ValueError, match=f"use objective='{shipped}' with loss_type='{normalization}'"):
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args, objective="drpo")


@pytest.mark.parametrize("objective, config, message", [
    ("drpo", dict(use_adaptive_entropy=True), "adaptive entropy bonus"),
    ("tis_ppo", {}, "uses π_rollout, but use_vllm=False: TRL keeps sampling log-probs only where vLLM generates"),
    ("drpo@rollout", {}, "uses @anchor = rollout, but use_vllm=False"),
    ("icepop", dict(use_vllm=True), "set vllm_importance_sampling_correction=False"),
])
def test_a_setting_training_cannot_run_with_is_refused_before_the_model_loads(tmp_path, objective, config, message):
    name, _, anchor = objective.partition("@")
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **config)
    with pytest.raises(ValueError, match=message):     # not the missing model's error
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args, objective=name,
                             objective_params={"anchor": anchor} if anchor else None)


@pytest.mark.parametrize("config, message", [
    (dict(epsilon=0.1), "epsilon=0.1: TRL's policy term reads this, and objective 'drpo' replaces that term: it would "
                        "have no effect; leave epsilon=0.2. In the objective: epsilon: the objective's clip parameters, "
                        "objective_params={'eps_low': 0.1, 'eps_high': 0.1}"),
    (dict(epsilon_high=0.28), "epsilon_high: the objective's upper clip, objective_params={'eps_high': 0.28}"),
    (dict(delta=1.5), "delta: TRL's two-sided clip written in the objective: δ = 1.5, min(min(r, δ)*A, "
                      "clip(r, 1 - ε_low, 1 + ε_high)*A)"),
    (dict(importance_sampling_level="sequence"), "importance_sampling_level: objective='gspo'"),
    (dict(epsilon=0.1, epsilon_high=0.28), "epsilon=0.1, epsilon_high=0.28: TRL's policy term reads these"),
])
def test_a_trl_setting_the_objective_replaces_is_refused_naming_its_equivalent(tmp_path, config, message):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **config)
    with pytest.raises(ValueError) as e:      # before the model loads: not the missing model's error
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args, objective="drpo")
    assert message in str(e.value), str(e.value)


def test_trls_delta_written_in_the_objective_as_the_refusal_says_is_trls_own_two_sided_clip():
    """TRL's own _compute_loss with delta, and ours with the objective the refusal names, on one batch
    (benchmarks/host_loss_speed.py's stand-in trainers: TRL's loss code, the model's forward left out)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import host_loss_speed
    theirs, ours, inputs = host_loss_speed.trl_harnesses(8, 32, seed=1)
    from openrlhf_drpo.trl import SUPERSEDED
    theirs.args.delta = 1.1
    formula = SUPERSEDED["delta"][1].format(1.1).split("δ = 1.1, ")[1]     # the refusal's own words
    ours.objective_loss = TrlObjectiveLoss(parse(f"ε_low = 0.2\nε_high = 0.28\nδ = 1.1\n{formula}\n", "delta.dsl"))
    got = []
    for cls, h in ((GRPOTrainer, theirs), (ObjectiveGRPOTrainer, ours)):
        loss = cls._compute_loss(h, None, inputs)
        loss.backward()
        got.append((loss.detach(), h.lp.grad))
    assert torch.allclose(got[0][0], got[1][0], rtol=1e-6) and torch.allclose(got[0][1], got[1][1], rtol=1e-5, atol=1e-9)
    # not vacuous: without δ, TRL's loss differs
    theirs.args.delta = None
    assert not torch.allclose(GRPOTrainer._compute_loss(theirs, None, inputs).detach(), got[0][0], rtol=1e-4)


def test_an_aggregation_parameter_is_refused_as_loss_type_normalizes(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="the aggregation is GRPOConfig.loss_type's normalization"):
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args, objective="drpo",
                             objective_params={"aggregate": "seq-mean-token-mean"})


# an objective's declared @aggregate, against the loss_type whose normalization would replace it
DECLARING = {m: parse(f"@aggregate = {m}\nr*A\n", f"{m}.dsl") for m in
             ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")}


@pytest.mark.parametrize("objective, loss_type, fix", [
    ("gspo", "dapo", "set loss_type='grpo', which aggregates so"),       # TRL's default: GSPO's line ignored before
    ("gspo", "bnpo", "set loss_type='grpo'"),
    ("token-mean", "grpo", "set loss_type='bnpo' or 'dapo'"),
    ("seq-mean-token-sum-norm", "dapo", "set loss_type='dr_grpo'"),
    ("seq-mean-token-sum", "grpo", "no TRL loss_type aggregates so"),
])
def test_an_aggregate_trls_loss_type_would_replace_is_refused_naming_the_loss_type_that_matches(tmp_path, objective,
                                                                                                  loss_type, fix):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type=loss_type)
    declared = "seq-mean-token-mean" if objective == "gspo" else objective
    with pytest.raises(ValueError) as e:       # before the model loads: not the missing model's error
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args,
                             objective=DECLARING.get(objective, objective))
    assert (f"declares @aggregate = {declared}, but loss_type={loss_type!r} aggregates as" in str(e.value)
            and fix in str(e.value)), str(e.value)


@pytest.mark.parametrize("objective, loss_type", [("gspo", "grpo"), ("token-mean", "bnpo"), ("token-mean", "dapo"),
                                                  ("seq-mean-token-sum-norm", "dr_grpo"), ("drpo", "grpo")])
def test_an_aggregate_trls_loss_type_honours_or_none_declared_is_accepted(tmp_path, objective, loss_type):
    # past our checks: what stops it is transformers not finding the model (no ValueError of ours)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type=loss_type)
    missing = tmp_path / "no-model-here"
    with pytest.raises(OSError, match=f"Repo id must be in the form .*: '{re.escape(str(missing))}'"):
        ObjectiveGRPOTrainer(model=str(missing), reward_funcs=reward, args=args,
                             objective=DECLARING.get(objective, objective))


def test_vllm_with_its_correction_off_is_accepted_for_an_objective_on_rollout_log_probs(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True,
                      vllm_importance_sampling_correction=False)
    # past our checks: what stops it is transformers not finding the model (no ValueError of ours)
    missing = tmp_path / "no-model-here"
    with pytest.raises(OSError, match=f"Repo id must be in the form .*: '{re.escape(str(missing))}'"):
        ObjectiveGRPOTrainer(model=str(missing), reward_funcs=reward, args=args, objective="icepop")


def test_tokens_vllm_could_not_score_get_ratio_one_not_a_nan_loss(tmp_path):
    """vLLM's NaN sampling log-probs, fed to the adapter's loss as TRL's inputs carry them
    (no vLLM here: a trainer built for an objective on μ is given tis_ppo, which reads π_rollout)."""
    model, _, model_dir = tiny_llama(str(tmp_path), SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", loss_type="bnpo",
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=5)
    trainer = ObjectiveGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, objective="grpo_clip_higher",
                                   train_dataset=Dataset.from_list([{"prompt": "w1 w2"}] * 4),
                                   processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.objective_loss = TrlObjectiveLoss("tis_ppo")
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(SPECIAL), len(SPECIAL) + len(WORDS), (4, 8), generator=g)
    old = -torch.rand(4, 5, generator=g) - 1
    sampling = old - 0.3 * torch.rand(4, 5, generator=g)
    inputs = dict(prompt_ids=ids[:, :3], prompt_mask=torch.ones(4, 3, dtype=torch.long), completion_ids=ids[:, 3:],
                  completion_mask=torch.ones(4, 5, dtype=torch.long), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                  old_per_token_logps=old)
    unscored = torch.zeros(4, 5, dtype=torch.bool)
    unscored[0, 2] = unscored[3, 4] = True
    nan_loss = trainer._compute_loss(trainer.model, {**inputs, "sampling_per_token_logps": sampling.masked_fill(
        unscored, float("nan"))})
    one_loss = trainer._compute_loss(trainer.model, {**inputs, "sampling_per_token_logps": torch.where(
        unscored, old, sampling)})
    raw_loss = trainer._compute_loss(trainer.model, {**inputs, "sampling_per_token_logps": sampling})
    assert torch.isfinite(nan_loss) and nan_loss.item() == one_loss.item() != raw_loss.item()


def test_a_bad_objective_stops_with_its_located_error_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.dsl"
    bad.write_text("δ = 1\nr*A - x\n")
    with pytest.raises(DslError) as e:     # not the missing model's error: the objective comes first
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, objective=str(bad))
    assert e.value.render().startswith(f"{bad}:2:7: error: unknown name 'x'")


@pytest.mark.parametrize("installed", ["1.17.0", "1.16.0.dev0"])
def test_another_trl_release_is_refused_before_the_model_loads_naming_both_versions(tmp_path, monkeypatch, installed):
    # a distribution's metadata first on sys.path is what importlib.metadata reports installed
    metadata = tmp_path / f"trl-{installed}.dist-info" / "METADATA"
    metadata.parent.mkdir()
    metadata.write_text(f"Metadata-Version: 2.1\nName: trl\nVersion: {installed}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=rf"trl {installed} is installed; it is built against trl==1\.16\.0, whose "
                                           r"private GRPOTrainer\._compute_loss it re-implements"):
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, objective="drpo")


@pytest.mark.parametrize("name", ["_compute_loss", "_get_per_token_logps_and_entropies", "get_high_entropy_mask",
                                  "get_off_policy_mask", "_generate_and_score_completions"])
def test_a_private_trl_method_whose_parameters_changed_is_refused_before_the_model_loads(tmp_path, monkeypatch, name):
    """A TRL whose private method lost a parameter (as a release might, under the same
    version only by a local patch: the version check comes first)."""
    signature = inspect.signature(getattr(GRPOTrainer, name))
    expected = list(signature.parameters)

    def changed(*args):
        pass
    changed.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:-1])
    monkeypatch.setattr(GRPOTrainer, name, changed)
    with pytest.raises(RuntimeError, match=re.escape(f"trl's GRPOTrainer.{name} takes {expected[:-1]}, expected "
                                                     f"{expected} (trl {TRL_VERSION}'s)")):
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, objective="drpo")


# one rank of a two-process gloo group (accelerate reads RANK, WORLD_SIZE and MASTER_*): the
# adapter's _compute_loss on this rank's batch, whose μ lies near π (log π ≈ -3 over the tiny
# model's 20-odd tokens) shifted by rank, so the ranks' ratio maxima and means differ; it prints its own metrics, what the trainer logged, and how many
# collectives the call made (gloo numbers each collective of the group)
RANK = """
import json, sys, torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig
from openrlhf_drpo.lab.toytask import SPECIAL, WORDS, tiny_llama
from openrlhf_drpo.trl import ObjectiveGRPOTrainer

directory, rank = sys.argv[1], int(sys.argv[2])
model, _, model_dir = tiny_llama(directory, SPECIAL + WORDS, seed=0, hidden=32)
model.save_pretrained(model_dir)
args = GRPOConfig(output_dir=directory + "/out", use_cpu=True, report_to="none", loss_type="bnpo",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=5)
trainer = ObjectiveGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=args, objective="drpo", objective_params={"delta": 0.02},
                               train_dataset=Dataset.from_list([{"prompt": "w1 w2"}] * 8),
                               processing_class=AutoTokenizer.from_pretrained(model_dir))
trainer.model.train()
trainer.current_gradient_accumulation_steps = 1
g = torch.Generator().manual_seed(rank)
ids = torch.randint(len(SPECIAL), len(SPECIAL) + len(WORDS), (4, 8), generator=g)
inputs = dict(prompt_ids=ids[:, :3], prompt_mask=torch.ones(4, 3, dtype=torch.long), completion_ids=ids[:, 3:],
              completion_mask=torch.ones(4, 5, dtype=torch.long), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
              old_per_token_logps=-3 - 0.4 * torch.rand(4, 5, generator=g) + 0.3 * rank)
group = torch.distributed.distributed_c10d._get_default_group()
before = group._get_sequence_number_for_group()
trainer._compute_loss(trainer.model, inputs)
collectives = group._get_sequence_number_for_group() - before
print(json.dumps(dict(world=trainer.accelerator.num_processes, collectives=collectives,
                      own={k: v.item() for k, v in trainer.objective_loss.metrics.logged().items()},
                      logged={k: v[-1] for k, v in trainer._metrics["train"].items()})))
"""


def test_metrics_are_reduced_over_ranks_as_trl_reduces_its_own_in_one_collective(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / f"rank{r}"), str(r)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ranks = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    own = [r["own"] for r in ranks]
    # not vacuous: the ranks' maxima differ, and so do their means (a fraction among them)
    assert own[0]["drpo_ratio_max"] != own[1]["drpo_ratio_max"]
    assert own[0]["drpo_past_boundary_diverging"] != own[1]["drpo_past_boundary_diverging"]
    for r in ranks:
        assert r["world"] == 2
        for key in METRICS:     # TRL: clip_ratio/high_max is the max over ranks; policy_loss their nanmean
            expected = max(o[key] for o in own) if key == "drpo_ratio_max" else (own[0][key] + own[1][key]) / 2
            assert math.isclose(r["logged"][key], expected, rel_tol=1e-6), (key, r["logged"], own)
        assert r["collectives"] == 2, r      # TRL's own entropy mean (an all-reduce) and our metrics (a gather)


def test_an_entropy_bonus_written_in_the_objective_logs_trls_own_entropy_coef_run(tmp_path):
    """bnpo with one loss call per step: TRL's bonus (its token mean of H over the call) and c·H
    in the objective (the same mean) are one term."""
    theirs = run(tmp_path / "trl", steps=2, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28, entropy_coef=0.05)
    bonus = parse("ε_low = 0.2\nε_high = 0.28\nmin(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) + 0.05*H\n", "bonus.dsl")
    ours = run(tmp_path / "ours", (bonus, {}), steps=2, loss_type="bnpo")
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert a.get("reward") == b.get("reward"), (a, b)
        for key in ("loss", "grad_norm", "entropy"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a, b)
    # not vacuous: the bonus is more of the loss than the tolerance could hide
    assert all(0.05 * b["entropy"] > 1e-3 * abs(b["loss"]) for b in theirs), theirs


def built(tmp_path, objective, prompts=4, **config):
    """An ObjectiveGRPOTrainer on the tiny model, not trained: its loss is called directly."""
    model, _, model_dir = tiny_llama(str(tmp_path), SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", seed=0, bf16=False,
                      **{"loss_type": "bnpo", "per_device_train_batch_size": 8, "num_generations": 4,
                         "max_completion_length": 5, **config})
    dataset = Dataset.from_list([{"prompt": " ".join(WORDS[(5 * i + j) % 16] for j in range(3))}
                                 for i in range(prompts)])
    trainer = ObjectiveGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, objective=objective,
                                   train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def by_hand(trainer, inputs):
    """(log π, H) of the completions from the model's full logits (not TRL's fused LM head), with
    their graphs: the hand-written references' inputs."""
    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    logits = trainer.model(input_ids=torch.cat([prompt, completion], 1),
                           attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)).logits
    logp = torch.log_softmax(logits[:, prompt.size(1) - 1:-1].float() / trainer.temperature, -1)
    return logp.gather(-1, completion[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def gradient(trainer, loss):
    trainer.model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_an_entropy_objectives_gradient_through_trls_entropies_equals_a_hand_written_one(tmp_path):
    trainer = built(tmp_path, parse("c = 0.05\nr*A + c*H\n", "entropy_bonus.dsl"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(SPECIAL), len(SPECIAL) + len(WORDS), (4, 8), generator=g)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 3:] = 0
    inputs = dict(prompt_ids=ids[:, :3], prompt_mask=torch.ones(4, 3, dtype=torch.long), completion_ids=ids[:, 3:],
                  completion_mask=mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                  old_per_token_logps=-3 - 0.4 * torch.rand(4, 5, generator=g))
    ours = gradient(trainer, trainer._compute_loss(trainer.model, inputs))

    def reference(c):     # bnpo: the token mean of -(r·A + c·H)
        logp, entropy = by_hand(trainer, inputs)
        term = torch.exp(logp - inputs["old_per_token_logps"]) * inputs["advantages"][:, None] + c * entropy
        return gradient(trainer, -(term * mask).sum() / mask.sum())
    assert torch.allclose(ours, reference(0.05), rtol=1e-4, atol=1e-7)
    assert not torch.allclose(ours, reference(0.0), rtol=1e-2, atol=1e-7)     # H's own gradient is in it


# a gradient-carrying group reduction: each response's mean log π pulled to its group's mean
GROUP = "s = seq_mean(log(π))\nr*A - 0.5*(s - group_mean(s))^2\n"


def test_each_loss_call_holds_whole_groups_whose_ids_are_trls_prompt_groups(tmp_path):
    trainer = built(tmp_path, parse(GROUP, "group_pull.dsl"), steps_per_generation=1)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))     # TRL's generation and shuffle
    # the prompts themselves say which rows share a prompt (the dataset's prompts are distinct)
    _, prompt_group = torch.unique(inputs["prompt_ids"], dim=0, return_inverse=True)
    ids = inputs["groups"]
    assert all(len(set(prompt_group[ids == i].tolist())) == 1 for i in ids.unique())
    assert all(len(set(ids[prompt_group == i].tolist())) == 1 for i in prompt_group.unique())
    assert torch.unique(ids, return_counts=True)[1].tolist() == [4, 4]     # two prompts, num_generations each
    assert ids.tolist() != sorted(ids.tolist())     # TRL shuffled the rows; the ids moved with them
    g = torch.Generator().manual_seed(1)
    mask = inputs["completion_mask"]
    inputs["old_per_token_logps"] = by_hand(trainer, inputs)[0].detach() - 0.2 * torch.rand(mask.shape, generator=g)
    inputs["advantages"] = torch.randn(mask.size(0), generator=g)
    ours = gradient(trainer, trainer._compute_loss(trainer.model, inputs))
    logp = by_hand(trainer, inputs)[0]
    s = (logp * mask).sum(-1) / mask.sum(-1)
    group_mean = torch.stack([s[prompt_group == prompt_group[i]].mean() for i in range(len(s))])
    term = torch.exp(logp - inputs["old_per_token_logps"]) * inputs["advantages"][:, None] \
        - 0.5 * ((s - group_mean) ** 2)[:, None]
    assert torch.allclose(ours, gradient(trainer, -(term * mask).sum() / mask.sum()), rtol=1e-4, atol=1e-7)


# objectives reading what TRL gives only under a setting, or not at all
REF, SUM_PI_SQ = "d = log(π_ref) - log(π)\nr*A - 0.1*(exp(d) - d - 1)\n", "r*A*(1 - sg(sum_π_sq))\n"
BATCH = "r*A - 0.1*(log(π) - batch_mean(log(π)))^2\n"
ENTROPY = "min(r*A, clip(r, 0.8, 1.2)*A) + 0.01*H\n"
MASK = (Path(__file__).resolve().parent.parent / "objectives" / "top_entropy.dsl").read_text(encoding="utf-8")


@pytest.mark.parametrize("text, config, message", [
    (REF, {}, "objective 'grpo_k3' uses π_ref, but beta=0.0: TRL loads the reference model only with beta > 0"),
    (SUM_PI_SQ, {}, r"objective 'otb_weight' uses sum_π_sq \(Σ_v π_v²\), but TRL's GRPOTrainer computes no "
     "Σ_v π_v²"),
    (GROUP, dict(gradient_accumulation_steps=2), "objective 'group_pull' uses group_mean .*, but "
     "steps_per_generation=2: TRL shuffles the rows of a generation batch and slices it into that many loss calls"),
    (GROUP, dict(per_device_train_batch_size=6), "uses group_mean .*, but per_device_train_batch_size=6 is not a "
     "multiple of num_generations=8: a prompt's group would straddle processes"),
    (GROUP, dict(eval_strategy="steps", per_device_eval_batch_size=6, num_generations_eval=4),
     "uses group_mean .*, but per_device_eval_batch_size=6 is not a multiple of num_generations_eval=4"),
    (BATCH, dict(gradient_accumulation_steps=2, steps_per_generation=1), "objective 'batch_pull' uses batch_mean .*, "
     "but steps_per_generation=1 is not a multiple of gradient_accumulation_steps=2: an optimizer step's "
     "micro-batches would come from two generation batches"),
    (ENTROPY, dict(entropy_coef=0.05), r"objective 'entropy_bonus' reads the entropy H and writes its own entropy "
     r"terms, to which TRL's entropy_coef=0.05 would add a second bonus; set entropy_coef=0.0"),
    (MASK, dict(top_entropy_quantile=0.2), r"objective 'top_entropy' writes its own entropy mask \(batch_quantile\(H, "
     r"q\)\), on which TRL's top_entropy_quantile=0.2 would mask a second time; set top_entropy_quantile=1.0"),
], ids=["pi_ref", "sum_pi_sq", "groups_sliced", "groups_straddle", "groups_straddle_eval", "batch_accumulated",
        "entropy_twice", "entropy_mask_twice"])
def test_an_input_trl_does_not_give_is_refused_before_the_model_loads_naming_the_setting(tmp_path, text, config,
                                                                                           message):
    name = {REF: "grpo_k3", SUM_PI_SQ: "otb_weight", GROUP: "group_pull", BATCH: "batch_pull",
            ENTROPY: "entropy_bonus", MASK: "top_entropy"}[text]
    # per-device sizes that are no multiple of the group: GRPOConfig refuses them on one process
    # (its global batch is the per-device one); a rank of several reads its config so
    per_device = {k: config.pop(k) for k in ("per_device_train_batch_size", "per_device_eval_batch_size")
                  if k in config}
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **config)
    for key, value in per_device.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=message):
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args,
                             objective=parse(text, f"{name}.dsl"))


def test_the_settings_that_give_each_input_are_accepted(tmp_path):
    # a real tiny model, so that the trainer is built whole: both checks (before the model loads and
    # on the config GRPOTrainer settles) let the setting through, and the loss reads the input it gives
    model, _, model_dir = tiny_llama(str(tmp_path), SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)
    data = dict(train_dataset=Dataset.from_list([{"prompt": "w1 w2"}] * 8),
                processing_class=AutoTokenizer.from_pretrained(model_dir))
    for text, config, given in [(REF, dict(beta=0.1), "ref_log_probs"), (GROUP, dict(steps_per_generation=1), "groups"),
                                (BATCH, dict(gradient_accumulation_steps=1), "batch")]:
        args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **config)
        trainer = ObjectiveGRPOTrainer(model=model_dir, reward_funcs=reward, args=args,
                                       objective=parse(text, "accepted.dsl"), **data)
        assert given in trainer.objective_loss.inputs(), (text, trainer.objective_loss.inputs())
        assert (trainer.ref_model is not None) == (given == "ref_log_probs")      # beta > 0: TRL's reference model
