# Adaptive entropy control (Skywork-OR1): PPO's clipped ratio plus on·α·H, the coefficient α moved by ±Δ
# after each optimizer step (up while the step's entropy is at or below the target, down above it,
# within [0, 1]), and applied only while the last step's entropy was at or below the target (on).
# Source: He et al. 2025, "Skywork Open Reasoner 1 Technical Report", arXiv 2505.22312, §3.2.3
# (adaptive entropy control); TRL 1.16.0's GRPOTrainer with use_adaptive_entropy=True (_compute_loss:
# entropy_coef, entropy_coef_delta, entropy_coef_min/max, entropy_target; _last_world_entropy starts at
# inf, so the bonus is off at the first step: on = 0). The entropy is the step's token mean of H over
# every rank, as TRL's window sums it.
ε_low = 0.2
ε_high = 0.2
H_target = 0.2
Δ = 0.005
α = 0
on = 0
H_mean = batch_mean(H)
α ← α + Δ·([H_mean <= H_target] - [H_mean > H_target]) in [0, 1]
on ← [H_mean <= H_target] in [0, 1]
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) + on·α·H
