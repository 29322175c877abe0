# SAPO: Soft Adaptive Policy Optimization. A sigmoid gate replaces the clip: f(r) = 4/τ·σ(τ(r-1)),
# whose gradient weight decays smoothly away from r = 1, faster for negative advantages.
# Source: Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347; τ = 1.0 for
# A > 0 and 1.05 otherwise, as the paper (verl's actor.yaml, TRL); per-sequence aggregation as verl.
@aggregate = seq-mean-token-mean
τ_pos = 1.0
τ_neg = 1.05
τ = [A > 0]*τ_pos + [A <= 0]*τ_neg
4/τ*sigmoid(τ*(r - 1))*A
