# VESPO: a gamma-shaped weight φ(W) = W^k·e^(λ(1-W)) of the response's product ratio W, whose
# log is the sum of clamped token log-ratios plus the rollout mismatch Σ log(π_old/π_rollout);
# φ is a detached REINFORCE weight (φ(1) = 1), with (k, λ) chosen by the advantage's sign.
# Source: "VESPO", arXiv 2602.10693; FloyedShen/VESPO recipe/vespo/code/core_algos.py
# (compute_policy_loss_vespo): k = 2, λ = 3 for A ≥ 0 and k = 3, λ = 2 for A < 0, token-mean.
# Its clamps, as there: each token's log-ratio to ±20 (log(r)), each token's mismatch weight to
# [1e-8, e^20] in log space, log W to ±20, and log W again to ≥ log(1e-8) in W^k alone. The
# source picks (k, λ) by the response's first advantage; here by each token's (the same for
# GRPO's one advantage per response).
k_pos = 2
λ_pos = 3
k_neg = 3
λ_neg = 2
floor = log(1e-8)
log_W = clip(seq_sum(log(r)) + seq_sum(clip(log(π_old) - log(π_rollout), floor, 20)), -20, 20)
k = [A >= 0]*k_pos + [A < 0]*k_neg
λ = [A >= 0]*λ_pos + [A < 0]*λ_neg
φ = exp(k*max(log_W, floor) + λ*(1 - exp(log_W)))
sg(φ)*A*log(π)
