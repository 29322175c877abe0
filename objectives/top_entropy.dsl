# Top-entropy mask (the 80/20 rule): PPO's clipped objective with a policy gradient only on the tokens whose
# entropy H is at or above the batch's q-quantile, the high-entropy minority ("forking" tokens; q = 0.8 keeps 20%).
# Source: Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement
# Learning for LLM Reasoning", arXiv 2506.01939; as TRL 1.16.0 writes it (GRPOConfig's top_entropy_quantile = 1 − q,
# GRPOTrainer.get_high_entropy_mask: torch.quantile of the unmasked tokens' entropies, kept where H ≥ it).
# Choices: the quantile is over the optimizer step's batch on one rank (batch_quantile refuses data-parallel
# ranks; TRL takes each loss call's tokens gathered over its processes, the same where a call is the step), in
# the loss's precision (TRL's in float32), interpolated as torch.quantile; a tie at the threshold is kept; H
# enters the condition only, with no gradient (as TRL's mask); PPO's symmetric ε = 0.2, a token mean.
# Locality: batch (each token's mask reads every token's H).
ε = 0.2
q = 0.8
[H >= batch_quantile(H, q)]*min(r*A, clip(r, 1 - ε, 1 + ε)*A)
