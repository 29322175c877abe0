"""TRL's own GRPOTrainer is the oracle for openrlhf_drpo.trl: a shipped objective that writes
TRL's clipped surrogate logs, step by step, the loss and reward TRL's own loss logs, under each
normalization loss_type names; num_iterations = 2 so that π ≠ μ and the clip acts. Real runs on
CPU with a tiny Llama and tokenizer built here."""
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from dsl import DslError
from openrlhf_drpo.toytask import SPECIAL, WORDS, tiny_llama
from openrlhf_drpo.trl import ObjectiveGRPOTrainer

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


def test_another_clip_differs_from_trls(tmp_path):
    theirs = run(tmp_path / "trl", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    ours = run(tmp_path / "ours", ("grpo_clip_higher", {"ε_low": 0.2, "ε_high": 0.05}), loss_type="dapo")
    assert any(not math.isclose(a["loss"], b["loss"], rel_tol=1e-3) for a, b in zip(ours, theirs))


def test_trls_kl_term_keeps_its_meaning(tmp_path):
    theirs = run(tmp_path / "trl", steps=2, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.1)
    ours = run(tmp_path / "ours", ("grpo_clip_higher", {}), steps=2, loss_type="dapo", beta=0.1)
    for a, b in zip(ours, theirs):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7) and math.isclose(a["kl"], b["kl"],
                                                                                                 rel_tol=1e-5)


def test_training_end_to_end_raises_the_reward_and_logs_our_metrics(tmp_path):
    log = run(tmp_path, ("drpo", {"delta": 0.2}), steps=16, lr=3e-2, loss_type="dapo")
    assert all(k in h for h in log for k in METRICS)
    rewards = [h["reward"] for h in log if "reward" in h]      # one per generation (num_iterations = 2)
    assert len(rewards) == 8 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards


@pytest.mark.parametrize("loss_type, shipped", [("cispo", "cispo"), ("sapo", "sapo"), ("luspo", "luspo"),
                                                ("vespo", "vespo")])
def test_a_loss_type_that_is_a_formula_is_refused_naming_ours(tmp_path, loss_type, shipped):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type=loss_type, report_to="none")
    with pytest.raises(ValueError, match=f"use objective='{shipped}'"):
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args, objective="drpo")


def test_a_bad_objective_stops_with_its_located_error_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.dsl"
    bad.write_text("δ = 1\nr*A - x\n")
    with pytest.raises(DslError) as e:     # not the missing model's error: the objective comes first
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, objective=str(bad))
    assert e.value.render().startswith(f"{bad}:2:7: error: unknown name 'x'")


def test_an_objective_on_rollout_log_probs_says_trl_keeps_none_without_vllm(tmp_path):
    with pytest.raises(ValueError, match="TRL keeps sampling log-probs only where vLLM generates"):
        run(tmp_path, ("drpo", {"anchor": "rollout"}), steps=1, loss_type="dapo")
