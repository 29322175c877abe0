# VESPO: a gamma-shaped weight φ(W) = W^k·e^(λ(1-W)) of the response's product ratio W, whose
# log is the sum of clamped token log-ratios plus the rollout mismatch Σ log(π_old/π_rollout);
# φ is a detached REINFORCE weight (φ(1) = 1), with (k, λ) chosen by the advantage's sign.
# Source: "VESPO", arXiv 2602.10693; FloyedShen/VESPO recipe/vespo/code/core_algos.py
# (compute_policy_loss_vespo): k = 2, λ = 3 for A ≥ 0 and k = 3, λ = 2 for A < 0, token-mean.
k_pos = 2
λ_pos = 3
k_neg = 3
λ_neg = 2
log_W = clip(seq_sum(log(r)) + seq_sum(log(π_old) - log(π_rollout)), -20, 20)
k = [A >= 0]*k_pos + [A < 0]*k_neg
λ = [A >= 0]*λ_pos + [A < 0]*λ_neg
φ = exp(k*log_W + λ*(1 - exp(log_W)))
sg(φ)*A*log(π)
