# PPO / GRPO ratio clip, symmetric ε = 0.2 (set ε_high for clip-higher).
# Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; the paper's Eq. (ppo_obj).
ε_low = 0.2
ε_high = 0.2
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
