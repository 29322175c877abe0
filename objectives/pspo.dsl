# PSPO: the unclipped surrogate on a smoothed ratio, ((1 − α)π + αμ)/μ·A. π is smoothed toward
# the behaviour policy before the ratio, in place of the clip: the gradient keeps every token,
# scaled by 1 − α.
# Source: Dwyer et al. 2025, "It's Not You, It's Clipping", arXiv 2509.21282; huggingface/trl PR
# #4548 (trust_region_method="pspo", open): α = 0.1, its smoothing_alpha default. The PR's code
# was not found: the ratio from the unclamped log-ratio and token-mean aggregation are TRL
# GRPOTrainer's (coef_1 = exp(log_ratio); loss_type "dapo"), where the PR plugs in.
α = 0.1
r_raw = exp(log(π) - log(μ))
((1 - α)*r_raw + α)*A
