# CTPO: Cumulative-Token Policy Optimization. Each token's ratio is the product of the ratios of its
# response up to it, R_t = ∏_{s≤t} r_s, clipped in log space within bounds that grow as √t, with a dual
# clip exp(c_dual·√t) for A < 0. The product is stop-gradient: a token's gradient is R_t·∇log π_t, its own.
# Source: Zhang et al. 2026, "Rethinking Importance Sampling in LLM Policy Optimization: A Cumulative Token
# Perspective", arXiv 2605.07331; the authors' code, horizon-llm/CTPO verl/trainer/ppo/core_algos.py
# (_compute_policy_loss_cum_token_la_impl, loss_mode cum-token-cumprod-la, commit acc4021): la_clip_low =
# 0.025, la_clip_high = 0.05, la_clip_c = 0.05 (log space), clip_ratio_la_power = 0.5 (ctpo.sh), token mean.
# As there: each token's log-ratio clamped to ±20 (log(r)), log R_t capped at 10, t the number of unmasked
# tokens up to this one. Locality: response (a prefix of the response).
c_low = 0.025
c_high = 0.05
c_dual = 0.05
p = 0.5
t = prefix_sum(1)
log_R = min(sg(prefix_sum(log(r))) + log(π) - sg(log(π)), 10)
L = min(exp(log_R)*A, exp(clip(log_R, -c_low*t^p, c_high*t^p))*A)
[A >= 0]*L + [A < 0]*max(L, exp(c_dual*t^p)*A)
