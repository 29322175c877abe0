# TOPR: Tapered Off-Policy REINFORCE, A·log π for A ≥ 0 and sg(min(π/μ, 1))·A·log π for A < 0.
# Positive samples are reinforced as in SFT, with no importance weight; negative ones are weighted
# by the (stopped) ratio tapered to [0, 1], so a bad token that became unlikely is pushed down
# less, and never more than on policy.
# Source: Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", arXiv 2503.14286, Eq. (8), as
# alibaba/ROLL implements it; roll/pipeline/rlvr/actor_pg_worker.py, _compute_topr_loss: the
# ratio is exp(log π − log μ) unclamped, both weights 1, per-sequence aggregation (ROLL's default
# loss_agg_mode). ROLL splits on the response's reward (> 0 or not), which an objective does not
# see; the sign of A stands in for it, as the issue states the method.
@aggregate = seq-mean-token-mean
r_raw = exp(log(π) - log(μ))
[A >= 0]*A*log(π) + [A < 0]*sg(min(r_raw, 1))*A*log(π)
