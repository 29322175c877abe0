# GIPO: the surrogate r·A with its gradient damped by a (stopped) Gaussian trust weight on log r.
# The weight w = exp(−(log r)²/(2σ²)) replaces the clip: 1 on policy, falling smoothly and never
# to exactly 0.
# Source: Lu et al. 2026, "GIPO: Gaussian Importance Sampling Policy Optimization", arXiv
# 2603.03955; only its abstract could be read (no code found), so the form is the abstract's
# ("a log-ratio-based Gaussian trust weight ... maintaining non-zero gradients") and these are
# choices: the weight stopped, so it shapes the gradient without a gradient of its own; σ = 0.2,
# one standard deviation at about PPO's ε = 0.2 (log 1.2 ≈ 0.18); r with OpenRLHF's ±20 clamp;
# token-mean aggregation.
σ = 0.2
sg(exp(-log(r)^2/(2*σ^2)))*r*A
