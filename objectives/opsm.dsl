# OPSM: Off-Policy Sequence Masking (DeepSeek-V3.2). A response with a negative advantage is
# dropped when the policy has drifted from the rollout policy by more than δ, measured as the
# mean over its tokens of log(π_rollout/π); the rest is the clipped GRPO objective.
# Source: DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv 2512.02556, Eq. (9); the mask's policy is the
# rollout engine's, as TRL's get_off_policy_mask; δ = 0.5 as TRL suggests (the paper gives none).
# The ratio is the raw exp(log π − log μ), as the paper and TRL's GRPOTrainer compute it (r would
# clamp log r to ±20 first, a different loss for a negative advantage past e^20).
@aggregate = seq-mean-token-mean
ε_low = 0.2
ε_high = 0.2
δ = 0.5
drifted = A < 0 and seq_mean(log(π_rollout) - log(π)) > δ
ρ = exp(log(π) - log(μ))
[not drifted]*min(ρ*A, clip(ρ, 1 - ε_low, 1 + ε_high)*A)
