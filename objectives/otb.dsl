# OTB: PPO on the advantage less the optimal token baseline B_t, a per-position mean over the prompt's
# responses. B_t is the mean of the host's A over the responses still running at position t, each
# weighted by its path variance so far, W_t = Σ_{j≤t} (1 − 2π_j + Σ_v π_v²); B_t = 0 where fewer than
# two responses run.
# Source: Li et al. 2026, "The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL", arXiv
# 2602.07078; verl 0.9.1's compute_optimal_token_baseline_advantage (trainer/ppo/core_algos.py), whose
# advantage G_t − B_t feeds verl's default (vanilla PPO) loss: B_t = Σ_i G_t·W_t / (Σ_i W_t + 1e-8) per
# position over the group, 0 for a group of one and past the second-longest response (handle_zero_tail).
# Choices: G is the host's A, so this equals verl's where A is the return G_t (verl's reward-to-go); a
# group-constant shift of A (GRPO's mean) cancels wherever two responses run, a division by the group's
# std scales the result. π_j is π_old (verl's), Σ_v π_v² the host's at the update (verl's old-policy one
# wherever the update is on-policy). Without verl's rollout-IS factor on W. The loss is verl's vanilla
# one: ε = 0.2 and the dual clip c = 3 (clip_ratio_c), token mean. Locality: group (Σ_v π_v² reads the
# policy), so each prompt's responses come whole in one call.
ε_low = 0.2
ε_high = 0.2
c = 3
W = prefix_sum(1 - 2π_old + sum_π_sq)
B = [group_count(A) >= 2]*group_sum(A*W)/(group_sum(W) + 1e-8)
adv = A - B
L = min(r*adv, clip(r, 1 - ε_low, 1 + ε_high)*adv)
[adv >= 0]*L + [adv < 0]*max(L, c*adv)
