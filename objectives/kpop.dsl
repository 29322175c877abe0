# KPop: PPO times π_old/π_rollout, a token kept while the Bernoulli KL of π_old and π_rollout is at
# most φ both ways. The KL is between the sampled token's Bernoulli (p, 1 − p) under each policy.
# Source: AReaL's rejection sampling with metric=binary_kl; areal-project/AReaL
# areal/utils/functional/functional.py (apply_rejection_sampling, compute_binary_kl_divergence,
# ppo_actor_loss_fn) and docs/en/algorithms/grpo_series.md ("KPop"): φ = 2 (its documented upper
# and examples/math/gsm8k_kpop.yaml), probabilities clamped to [1e-8, 1 − 1e-8] before the KL, a
# token kept when the larger KL is ≤ φ; PPO's ratio and the IS weight from unclamped log-ratios,
# ε = 0.2 (AReaL's default; that example uses 0.4); token-mean over all valid tokens, the dropped
# ones included. As in AReaL, in float32 1 − 1e-8 rounds to 1: a token with π_old and π_rollout both
# within 1e-7 of 1 gets a NaN KL and is dropped (float64 keeps it; the analysis is float64).
ε_low = 0.2
ε_high = 0.2
φ = 2
p = clip(π_old, 1e-8, 1 - 1e-8)
q = clip(π_rollout, 1e-8, 1 - 1e-8)
kl_fwd = p*log(p/q) + (1 - p)*log((1 - p)/(1 - q))
kl_rev = q*log(q/p) + (1 - q)*log((1 - q)/(1 - p))
k = exp(log(π_old) - log(π_rollout))
r_raw = exp(log(π) - log(μ))
[kl_fwd <= φ and kl_rev <= φ]*k*min(r_raw*A, clip(r_raw, 1 - ε_low, 1 + ε_high)*A)
