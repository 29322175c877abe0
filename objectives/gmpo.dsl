# GMPO: Geometric-Mean Policy Optimization. Each token's log-ratio is clipped in log space,
# one-sidedly by the sign of A, before the geometric mean; the response's mean advantage scales it.
# Source: Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673, Eq. (4);
# ε = 0.4, a ratio range of (e^-0.4, e^0.4), as the paper (and verl's and TRL's GMPO). The
# log-ratio is the raw log π − log μ, as in verl's compute_policy_loss_geo_mean (its ±20 clamp is
# commented out) and TRL: log(r) would clamp it to ±20, a different loss past that.
@aggregate = seq-mean-token-mean
ε = 0.4
x = log(π) - log(μ)
x_kept = sign(A)*min(sign(A)*x, sign(A)*clip(x, -ε, ε))
seq_mean(A)*exp(seq_mean(x_kept))
