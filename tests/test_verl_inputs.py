"""π_ref, H (with its gradient) and group ids under verl 0.9.1: tests/verl_actor.py runs verl's own
actor update in verl's venv (its engine's micro-batching, forward and backward, and the actor loss
its worker binds), each dsl: objective against verl's own term for that input, in loss and in every
parameter's gradient (float64); what verl withholds is refused, naming the setting or verl's code."""
import json
import os
import subprocess

import pytest

from test_verl import KL_FORMS, ROOT, VERL_PYTHON


@pytest.fixture(scope="module")
def actor():
    assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run bash scripts/setup_verl.sh"
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([str(VERL_PYTHON), str(ROOT / "tests" / "verl_actor.py"), json.dumps(KL_FORMS)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# ours (its input from verl's actor loss) = verl's own term for that input:
#   grpo_k3: use_kl_loss=True, kl_loss_coef=0  = vanilla + kl_loss_coef·kl_penalty(low_var_kl), 0.04
#   entropy_bonus: calculate_entropy=True      = vanilla − entropy_coeff·agg_loss(entropy), 0.01
#   grpo_norm (A normalised in its uid group)  = vanilla on compute_grpo_outcome_advantage's A
HELD = ["grpo_k3", "entropy_bonus", "grpo_norm"]
AGGS = ["token-mean", "seq-mean-token-mean"]


@pytest.mark.parametrize("packed", ["", ":rmpad"])      # verl's padded forward, and its packed one
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", HELD)
def test_an_objective_on_pi_ref_entropy_or_groups_equals_verls_own_term_through_its_actor_update(actor, name, agg,
                                                                                                  packed):
    row = actor["held"][f"{name}:{agg}{packed}"]
    assert row["same"], row
    # not vacuous: another coefficient, verl's term left out, or A not normalised, each differs
    control = actor["held"][f"control_{dict(grpo_k3='k3', entropy_bonus='entropy', grpo_norm='groups')[name]}:{agg}"
                            f"{packed}"]
    assert not control["same"] and control["grad_diff"] > 1e-8, control


@pytest.mark.parametrize("form", KL_FORMS)
def test_each_verl_kl_loss_type_written_in_the_objective_equals_verls_kl_loss_through_its_actor_update(actor, form):
    assert actor["held"][f"kl:{form}"]["same"], actor["held"][f"kl:{form}"]


def test_the_entropys_own_gradient_reaches_the_model(actor):
    # the same bonus with H's gradient cut: verl's value, another gradient
    row = actor["held"]["entropy_no_grad"]
    assert row["loss_diff"] <= 1e-12 and row["grad_diff"] > 1e-8, row


def test_groups_span_several_micro_batches_each_holding_whole_prompts(actor):
    assert actor["held"]["grpo_norm:two_prompts_per_micro_batch"]["same"]


GROUPS = ("objective 'grpo_norm' uses group_mean, group_std (each prompt's responses whole in one loss call, with "
          "their group ids), but verl's micro-batch need not hold a prompt's responses whole ({}): verl keeps them "
          "whole with trainer.use_v1=False and trainer.balance_batch=False (its v1 trainer balances every batch: "
          "trainer_base._balance_batch), actor_rollout_ref.actor.shuffle=False, use_dynamic_bsz=False and "
          "ppo_micro_batch_size_per_gpu a multiple of rollout.n=4 (its actor sets no force_group_size: "
          "ray_trainer._update_actor)")
REFUSED = {
    # the objective's term replaces verl's: both set is refused
    "entropy_coeff": ("actor_rollout_ref.actor.entropy_coeff=0.01: verl adds its own entropy bonus (entropy_coeff·H) "
                      "to the loss, and the objective 'entropy_bonus' has its own: leave entropy_coeff=0 (the "
                      "objective's term replaces verl's)"),
    "kl_loss_coef": ("actor_rollout_ref.actor.kl_loss_coef=0.001: verl adds its own KL to the reference (low_var_kl) "
                     "to the loss, and the objective 'grpo_k3' has its own: leave kl_loss_coef=0 (the objective's "
                     "term replaces verl's)"),
    "kl_in_reward": ("algorithm.use_kl_in_reward=True: verl adds its own KL penalty to the rewards "
                     "(ray_trainer.apply_kl_penalty), and the objective 'grpo_k3' has its own KL to π_ref: set "
                     "algorithm.use_kl_in_reward=False and actor_rollout_ref.actor.use_kl_loss=True with "
                     "kl_loss_coef=0 (the objective's term replaces verl's)"),
    # an input verl's settings withhold
    "no_entropy": ("objective 'entropy_bonus' uses H (the entropy, with its gradient), but verl's actor computed no "
                   "entropy at the update: it does only with actor_rollout_ref.actor.calculate_entropy=True or "
                   "entropy_coeff != 0 (ray_trainer._update_actor); set calculate_entropy=True"),
    "no_ref_log_prob": ("objective 'grpo_k3' uses π_ref, but verl's batch has no ref_log_prob: verl computes it only "
                        "with actor_rollout_ref.actor.use_kl_loss=True or algorithm.use_kl_in_reward=True "
                        "(trainer/ppo/utils.py need_reference_policy); set use_kl_loss=True with kl_loss_coef=0"),
    "not_through_the_actor": ("objective 'entropy_bonus' uses H (the entropy, with its gradient), but this "
                              "policy-loss call did not come through verl's actor loss "
                              "(verl.workers.utils.losses.ppo_loss), which alone holds it"),
    # groups split: by a setting, or (trainer.use_v1, trainer.balance_batch, which the actor's config
    # does not hold) by verl's own balancing of the rows, seen in the micro-batch's uids
    "shuffle": GROUPS.format("shuffle=True"),
    "dynamic_bsz": GROUPS.format("use_dynamic_bsz=True"),
    "micro_batch_size": GROUPS.format("ppo_micro_batch_size_per_gpu=2"),
    "balance_batch": GROUPS.format("uid 'p3' has 1 of its 4 responses in this micro-batch"),
    # verl never computes Σ_v π_v² at the update
    "otb": ("objective 'otb' uses sum_π_sq (Σ_v π_v²), but verl computes no Σ_v π_v² at the update: its trainer "
            "sets calculate_sum_pi_squared only for the old policy's forward (ray_trainer._compute_old_log_prob, for "
            "OTB's advantage estimator), never in _update_actor's batch, so the policy being trained has none"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_verl_withholds_or_a_verl_term_the_objective_replaces_is_refused_by_name(actor, case):
    assert actor["refused"][case] is not None and actor["refused"][case].endswith(REFUSED[case]), actor["refused"][case]
