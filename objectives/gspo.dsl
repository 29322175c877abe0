# GSPO: Group Sequence Policy Optimization. One ratio per response, the geometric mean of its
# token ratios, clipped as PPO clips a token's; every token of a response gets its gradient.
# Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, Eqs. (5)-(7);
# clip 3e-4 below and 4e-4 above as its §5.1 (and verl's GSPO example); per-sequence aggregation.
# Equals OpenRLHF 0.11.2 PolicyLoss(policy_loss_type="gspo") with the same clip.
@aggregate = seq-mean-token-mean
ε_low = 3e-4
ε_high = 4e-4
s = exp(seq_mean(log(π) - log(μ)))
min(s*A, clip(s, 1 - ε_low, 1 + ε_high)*A)
