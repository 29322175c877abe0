# AReaL's decoupled PPO with the proximal policy approximated from the policy versions: PPO's clip
# around π_prox, times the behaviour weight π_prox/μ, dropped where it exceeds cap. π_prox is
# interpolated between μ (the behaviour policy, the rollout's) and π (detached) in log space by
# α = (v_prox − v_behave)/(v_θ − v_behave), v_prox = v_θ − 1: α = (s − 1)/s at staleness s > 0,
# clamped to [0, 1], 0 at s = 0 (then π_prox = μ: PPO on the behaviour policy).
# Source: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
# Reasoning", arXiv 2505.24298, Eq. (5); the approximation: Li, Wu, Shen 2025, "A-3PO: Accelerating
# Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation", arXiv 2512.06547, as
# inclusionAI/AReaL's compute_prox_logp_approximations (prox_logp_method: loglinear,
# docs/algorithms/prox_approx.md); eps_clip 0.4 and behav_imp_weight_cap 5 as its GSM8K examples.
@anchor = rollout
ε_low = 0.4
ε_high = 0.4
cap = 5
α = clip((staleness - 1)/max(staleness, 1), 0, 1)
log_prox = log(μ) + α*(sg(log(π)) - log(μ))
q = exp(log(π) - log_prox)
w = exp(log_prox - log(μ))
[w <= cap]*w*min(q*A, clip(q, 1 - ε_low, 1 + ε_high)*A)
