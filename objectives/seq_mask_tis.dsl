# Sequence-masked TIS: keep a response while the geometric mean of its train/rollout ratios
# π_old/π_rollout is in [low, high]; survivors keep each token's own IS weight on PPO's objective.
# Source: OpenRLHF 0.11.2 PolicyLoss(is_correction_level="seq", is_correction_mode="mask",
# is_correction_gating="ratio"), after Yao et al.'s TIS and verl's rollout_is "seq" mask;
# [0.5, 5] as OpenRLHF's is_correction_threshold default.
ε_low = 0.2
ε_high = 0.2
low = 0.5
high = 5
k = exp(log(π_old) - log(π_rollout))
g = exp(seq_mean(log(π_old) - log(π_rollout)))
[low <= g and g <= high]*k*min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
