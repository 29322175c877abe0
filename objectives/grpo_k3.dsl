# GRPO with the k3 estimator of KL(π‖π_ref): PPO's clipped ratio minus β·k3, k3 = π_ref/π − log(π_ref/π) − 1.
# Per token, averaged over each response's tokens and then over the responses.
# Source: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
# Models", arXiv 2402.03300, §4.1 (GRPO's objective with the KL estimator of Schulman's blog), as TRL 1.16.0
# documents it (docs/source/grpo_trainer.md); β = 0.04 (the paper's KL coefficient), ε = 0.2 (TRL's epsilon).
# k3 is computed from the log-probs, exp(log π_ref − log π), unclamped, as TRL's _compute_loss; the ratio is
# the host's (its log clamped to ±20). TRL's use_bias_correction_kl (its default) multiplies k3 by r: write
# r*k3 for that form. Its locality is token: it needs π_ref, nothing else.
@aggregate = seq-mean-token-mean
ε_low = 0.2
ε_high = 0.2
β = 0.04
x = log(π_ref) - log(π)
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) - β*(exp(x) - x - 1)
