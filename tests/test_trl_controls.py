"""ObjectiveGRPOTrainer with an objective with memory (issue 48): the state updated once after each
optimizer step, logged (drpo_<name>, drpo_step), saved with TRL's checkpoint and restored on
resume. TRL 1.16.0's own adaptive entropy controller (use_adaptive_entropy) is the oracle for
objectives/adaptive_entropy.dsl over a real run. Real runs on CPU with the tiny Llama of
tests/test_trl.py, two micro-batches per optimizer step."""
import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dsl import parse
from openrlhf_drpo.lab.toytask import SPECIAL, WORDS, tiny_llama
from openrlhf_drpo.trl import CONTROL_STATE, ObjectiveGRPOTrainer
from test_accumulation_trl import run_two_ranks
from test_trl import reward

PROMPTS = Dataset.from_list([{"prompt": " ".join(WORDS[(3 * i + j) % 16] for j in range(4))} for i in range(64)])
# an entropy target the tiny model's step entropy (≈ 2.99, falling as it learns at this rate)
# crosses both ways within 8 steps: α rises, falls back to its bound, rises; the bonus switches on
TARGET, LR, STEPS = 2.98, 3e-3, 8
TRL_ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.0, entropy_coef_delta=0.005, entropy_coef_min=0.0,
                    entropy_coef_max=1.0, entropy_target=TARGET)
# a controlled β that moves every step with the step's entropy (unclipped: H/3 - 1 ≈ -0.005), and
# `step` in the objective: a resume that lost either changes the values and the loss
MEMORY = parse("H_target = 3\nβ = 0.1\nβ ← β·(1 + clip(batch_mean(H)/H_target - 1, -0.2, 0.2)) in [0, 1]\n"
               "min(r*A, clip(r, 0.8, 1.2)*A) + β·min(step/2, 1)·H\n", "memory.dsl")


def trainer(tmp_path, objective=None, steps=STEPS, accumulation=2, callbacks=(), **config):
    """A GRPO trainer on the tiny model: TRL's own loss (objective None) or ours; each optimizer step
    is 8 completions (2 prompts × 4) in `accumulation` micro-batches."""
    model, _, model_dir = tiny_llama(str(tmp_path), SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=8 // accumulation,
                      gradient_accumulation_steps=accumulation, num_generations=4, max_completion_length=6,
                      max_steps=steps, learning_rate=LR, logging_steps=1, report_to="none", seed=0, data_seed=0,
                      bf16=False, temperature=1.0, dataloader_num_workers=0, disable_tqdm=True, beta=0.0,
                      **{"loss_type": "bnpo", "save_strategy": "no", **config})
    kwargs = dict(model=model_dir, reward_funcs=reward, args=args, train_dataset=PROMPTS,
                  processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=list(callbacks))
    if objective is None:
        return GRPOTrainer(**kwargs)
    name, params = objective
    return ObjectiveGRPOTrainer(objective=name, objective_params=params, **kwargs)


def train(t, **kwargs):
    torch.manual_seed(0)
    t.train(**kwargs)
    return [h for h in t.state.log_history if "loss" in h]


class AfterEachStep(TrainerCallback):
    """Calls `fn(state, control)` after each optimizer step (the test's probe into a trainer)."""

    def __init__(self, fn):
        self.fn = fn

    def on_step_end(self, args, state, control, **kwargs):
        self.fn(state, control)


def test_trls_adaptive_entropy_and_the_declared_one_give_the_same_coefficients_and_losses_step_by_step(tmp_path):
    """TRL's controller (α ± Δ in [0, 1] from the step's world entropy, the bonus applied while the
    last step's entropy <= target) against objectives/adaptive_entropy.dsl. loss_type='bnpo': each
    micro-batch's token mean over gradient_accumulation_steps, which is how TRL scales its bonus
    (independent of loss_type), so both runs take the same gradient and stay on one trajectory."""
    theirs, seen = trainer(tmp_path / "trl", **TRL_ADAPTIVE), []
    theirs.add_callback(AfterEachStep(lambda state, control: seen.append(
        (theirs.entropy_coef, float(theirs._last_world_entropy <= TARGET)))))
    trl_log = train(theirs)
    ours = train(trainer(tmp_path / "ours", ("adaptive_entropy", {"H_target": TARGET})))
    assert len(ours) == len(trl_log) == len(seen) == STEPS
    assert [h["drpo_alpha"] for h in ours] == [c for c, _ in seen] == [h["entropy_coef"] for h in trl_log]
    assert [h["drpo_on"] for h in ours] == [on for _, on in seen]
    assert [h["drpo_step"] for h in ours] == list(range(1, STEPS + 1))
    # the run tells: α rises and falls back, the bonus switches on and off
    alphas = [c for c, _ in seen]
    assert max(alphas) > 0 and any(a > b for a, b in zip(alphas, alphas[1:])) and {0.0, 1.0} <= {on for _, on in seen}
    for a, b in zip(ours, trl_log):
        for key in ("loss", "grad_norm", "entropy"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a, b)


def stop_at(k):
    def stop(state, control):
        if state.global_step == k:
            control.should_training_stop = True
    return AfterEachStep(stop)


def test_a_run_resumed_from_its_checkpoint_continues_the_values_the_step_and_the_losses(tmp_path):
    k, n = 3, 6
    complete = trainer(tmp_path / "whole", (MEMORY, {}), steps=n, per_device_eval_batch_size=4)
    whole = train(complete)
    # evaluation neither counts its loss calls nor updates: the state after it is the state before
    state = complete.objective_loss.control_state()
    complete.evaluate(eval_dataset=PROMPTS.select(range(2)))
    assert complete.objective_loss.control_state() == state and state["step"] == n
    first = train(trainer(tmp_path / "stopped", (MEMORY, {}), steps=n, callbacks=[stop_at(k)], save_strategy="steps",
                          save_steps=k))
    checkpoint = tmp_path / "stopped" / "out" / f"checkpoint-{k}"
    saved = json.loads((checkpoint / CONTROL_STATE).read_text())
    assert saved["step"] == k and saved["values"]["beta"] == first[-1]["drpo_beta"]
    # the resumed trainer's log_history starts with the checkpoint's k steps
    rest = train(trainer(tmp_path / "stopped", (MEMORY, {}), steps=n), resume_from_checkpoint=str(checkpoint))[k:]
    assert len(first) == k and len(rest) == n - k and len(whole) == n
    for a, b in zip(first + rest, whole):
        assert a["drpo_step"] == b["drpo_step"] and math.isclose(a["drpo_beta"], b["drpo_beta"], rel_tol=1e-12), (a, b)
        for key in ("loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), (key, a, b)
    # the values move every step: a resume at the declared values would differ
    assert len({h["drpo_beta"] for h in whole}) == n


def recording_training_calls(t):
    """Each training call's (H, mask) as the trainer's loss receives them (the update reads those)."""
    calls, forward = [], t.objective_loss.forward

    def recording(log_probs, old, A, mask=None, **kw):
        if torch.is_grad_enabled():
            calls.append((kw["entropy"].detach().double(), mask.bool()))
        return forward(log_probs, old, A, mask, **kw)
    t.objective_loss.forward = recording
    return calls


def test_the_statistic_of_two_accumulated_micro_batches_is_the_whole_steps_and_one_micro_batchs(tmp_path):
    """β ← β·(1 + clip(batch_mean(H)/3 - 1, ±0.2)) under gradient_accumulation_steps=2: each step's
    update reads the token mean of H over both micro-batches (by hand, float64, from the entropies
    the loss calls received), and equals the run whose step is one micro-batch of the same 8
    completions. loss_type='grpo': the mean over responses, the same gradient either way."""
    accumulated = trainer(tmp_path / "two", (MEMORY, {}), steps=4, loss_type="grpo")
    calls = recording_training_calls(accumulated)
    two = train(accumulated)
    one = train(trainer(tmp_path / "one", (MEMORY, {}), steps=4, accumulation=1, loss_type="grpo"))
    assert len(calls) == 2 * len(two) == 2 * len(one) == 8
    beta, off = 0.1, []
    for step, h in enumerate(two):
        (h1, m1), (h2, m2) = calls[2 * step:2 * step + 2]
        whole = (h1[m1].sum() + h2[m2].sum()).item() / (m1.sum() + m2.sum()).item()
        expected = beta * (1 + min(max(whole / 3 - 1, -0.2), 0.2))
        assert math.isclose(h["drpo_beta"], expected, rel_tol=1e-12), (step, h["drpo_beta"], expected)
        # the case can tell: the mean of the micro-batches' means is another number
        means = (h1[m1].mean().item() + h2[m2].mean().item()) / 2
        off.append(abs(beta * (1 + means / 3 - 1) - expected) / expected)
        beta = h["drpo_beta"]
    assert max(off) > 1e-6, off
    for a, b in zip(two, one):
        assert math.isclose(a["drpo_beta"], b["drpo_beta"], rel_tol=1e-7), (a["drpo_beta"], b["drpo_beta"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7), (a["loss"], b["loss"])


def test_a_run_that_starts_at_step_0_starts_from_the_declared_values_not_a_state_left_over(tmp_path):
    """A second train(), or auto_find_batch_size's retry after an out-of-memory error, begins at
    global step 0: the objective's state from before (here: one loaded by hand) is dropped."""
    t = trainer(tmp_path, (MEMORY, {}), steps=1)
    t.objective_loss.load_control_state({"version": 1, "objective": "memory", "step": 5, "values": {"beta": 0.5}})
    (h,) = train(t)
    assert h["drpo_step"] == 1 and abs(h["drpo_beta"] - 0.1) < 0.02, h


def refusal(tmp_path, objective, files, global_step=3):
    """A trainer of `objective` resuming from a checkpoint folder holding `files` (name: text): what
    Trainer._load_optimizer_and_scheduler, which train(resume_from_checkpoint=) calls once the
    checkpoint's TrainerState is loaded, raises (no optimizer file: Trainer loads none)."""
    t = trainer(tmp_path, objective)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name, text in files.items():
        (checkpoint / name).write_text(text)
    t.state.global_step = global_step
    with pytest.raises(ValueError) as e:
        t._load_optimizer_and_scheduler(str(checkpoint))
    return str(e.value)


STATE = json.dumps({"version": 1, "objective": "memory", "step": 3, "values": {"beta": 0.09}})


@pytest.mark.parametrize("objective, files, global_step, message", [
    ((MEMORY, {}), {}, 3, "objective 'memory' has memory (its controlled parameters and step), but checkpoint "),
    ((MEMORY, {}), {"entropy_ctrl_state.json": "{}"}, 3, f"holds no {CONTROL_STATE}: it was saved by another"),
    (("grpo_clip_higher", {}), {CONTROL_STATE: STATE}, 3, "but objective 'grpo_clip_higher' has none"),
    ((MEMORY, {}), {CONTROL_STATE: STATE}, 4, "holds the objective's state at step 3, but the checkpoint is at "
                                                 "global step 4 (the objective's step 4)"),
    ((MEMORY, {"step": 10}), {CONTROL_STATE: STATE}, 3, "at step 3, but the checkpoint is at global step 3 (the "
                                                           "objective's step 13)"),
    (("adaptive_entropy", {}), {CONTROL_STATE: STATE}, 3, "the saved state is objective 'memory's, not 'adaptive_entropy's"),
], ids=["no-state", "trls-state-only", "state-of-memory-for-none", "another-step", "another-first-step",
        "another-objective"])
def test_a_checkpoint_that_cannot_hold_this_runs_state_is_refused_on_resume(tmp_path, objective, files, global_step,
                                                                           message):
    assert message in refusal(tmp_path, objective, files, global_step)


@pytest.mark.parametrize("first", [0, 10])
def test_a_checkpoints_state_at_the_objectives_step_is_restored(tmp_path, first):
    """The state of step first + 3 in a checkpoint of global step 3 (an objective whose `step` starts at
    `first`) is the one the trainer's loss holds after the load."""
    t = trainer(tmp_path, (MEMORY, {"step": first}))
    (tmp_path / "checkpoint").mkdir()
    state = {"version": 1, "objective": "memory", "step": first + 3, "values": {"beta": 0.09}}
    (tmp_path / "checkpoint" / CONTROL_STATE).write_text(json.dumps(state))
    t.state.global_step = 3
    t._load_optimizer_and_scheduler(str(tmp_path / "checkpoint"))
    assert t.objective_loss.control_state() == state and float(t.objective_loss.objective.params["beta"]) == 0.09


def test_trls_own_adaptive_entropy_beside_an_objective_with_memory_is_refused_naming_the_objective_that_writes_it(
        tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **TRL_ADAPTIVE)
    with pytest.raises(ValueError) as e:     # before the model loads: not the missing model's error
        ObjectiveGRPOTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=reward, args=args,
                             objective="adaptive_entropy")
    assert ("its controller would run beside the objective's own memory (a second controller)" in str(e.value)
            and "objective='adaptive_entropy'" in str(e.value)), str(e.value)


# one rank of a two-process gloo group (accelerate reads RANK, WORLD_SIZE and MASTER_*): 2 steps of
# 2 micro-batches, each training call's (H, mask) and the values after each step saved to a file
RANK = """
import pathlib, sys, torch
import test_trl_controls as t
directory, rank = pathlib.Path(sys.argv[1]), sys.argv[2]
run = t.trainer(directory / f"rank{rank}", (t.MEMORY, {}), steps=2)
calls, values = t.recording_training_calls(run), []
run.add_callback(t.AfterEachStep(lambda state, control: values.append(dict(run.objective_loss.controller.values))))
run.train()
torch.save({"calls": calls, "values": values, "world": torch.distributed.get_world_size()}, directory / f"{rank}.pt")
"""


def test_two_ranks_with_different_data_hold_the_same_values_from_the_statistic_of_both(tmp_path):
    run_two_ranks(RANK, tmp_path)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["values"] == ranks[1]["values"]
    beta, own = 0.1, []
    for step, values in enumerate(ranks[0]["values"]):
        per_rank = [[(h[m].sum().item(), m.sum().item()) for h, m in r["calls"][2 * step:2 * step + 2]] for r in ranks]
        tokens = [(sum(s for s, _ in p), sum(n for _, n in p)) for p in per_rank]
        whole = sum(s for s, _ in tokens) / sum(n for _, n in tokens)
        assert math.isclose(values["beta"], beta * (1 + whole / 3 - 1), rel_tol=1e-12), (step, values, whole)
        # the case can tell: each rank's own statistic gives each rank another value
        own.append([abs(beta * (s / n) / 3 - values["beta"]) / values["beta"] for s, n in tokens])
        beta = values["beta"]
    assert min(max(o) for o in own) > 1e-6, own
