# Unbiased KL gradient: PPO's clipped objective minus β·KL(π‖π_ref), the KL's value the k1 estimator
# but its gradient the importance-weighted reverse-KL one, w·log(π/π_ref)·∇log π, w = min(π/π_old, 10).
# Source: OpenRLHF PR #1309, "Fix reverse-KL gradient on the KL-as-loss path" (--algo.kl.use_loss
# --algo.kl.unbiased_gradient), as OpenRLHF 0.11.2 ships it. Its compute_approx_kl (openrlhf/models/utils.py)
# is straight-through: value.detach() + g − g.detach(), g = w·log(π/π_ref)²/2, w detached and clamped at
# KL_IS_WEIGHT_CLIP = 10 (w_max), from the raw log π − log π_old; ppo_actor.py adds it to PolicyLoss's as
# loss + kl_ctl·KL, both aggregated alike. Defaults as OpenRLHF's: kl.estimator = k1 (its value clamped to
# ±10), kl.init_coef β = 0.01, PolicyLoss's ε = 0.2, a token mean. k3's value is
# clip(exp(−max(x, −10)) − 1 + max(x, −10), −10, 10): the gradient is the same for every estimator.
ε_low = 0.2
ε_high = 0.2
β = 0.01
w_max = 10
x = log(π) - log(π_ref)
w = min(exp(log(π) - log(μ)), w_max)
g = sg(w)*x^2/2
kl = sg(clip(x, -10, 10)) + g - sg(g)
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) - β*kl
