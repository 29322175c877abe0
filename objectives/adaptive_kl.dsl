# Adaptive-KL PPO: PPO's clipped ratio minus β·KL(π‖π_ref), β steered after each optimizer step towards
# a target KL by a clipped proportional error: β ← β·(1 + clip(KL/KL_target − 1, −0.2, 0.2)·n/horizon).
# Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593,
# §2.2 (β_{t+1} = β_t(1 + K_β e_t), e_t = clip(KL_t/KL_target − 1, −0.2, 0.2)); OpenRLHF 0.11.2's
# AdaptiveKLController (trainer/ppo_utils/kl_controller.py), its update(current, n_steps) step by step.
# KL is OpenRLHF's status["kl"]: each response's token mean of log π_old − log π_ref (its k1), averaged
# over the responses; n the step's responses (OpenRLHF updates once per rollout, n its samples). β's
# bounds are this file's: OpenRLHF has none, and inside them the two agree (tests/test_controls.py).
ε_low = 0.2
ε_high = 0.2
kl_target = 6
horizon = 10000
β = 0.05
KL = batch_mean(seq_mean(log(π_old) - log(π_ref)))
n = batch_count(seq_len)
β ← β·(1 + clip(KL/kl_target - 1, -0.2, 0.2)·n/horizon) in [0, 10]
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) - β·(log(π) - log(π_ref))
