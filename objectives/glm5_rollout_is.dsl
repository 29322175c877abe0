# GLM-5 rollout IS: REINFORCE weighted by the ratio against the rollout policy itself (no π_old),
# detached, and zero outside the band (1 - ε_low, 1 + ε_high).
# Source: GLM-5 Team 2026, "GLM-5", arXiv 2602.15763; the form of SkyRL's rollout_is_policy_loss
# ("GLM-5 agentic inspired"), whose defaults are ε_low = ε_high = 0.2.
@anchor = rollout
ε_low = 0.2
ε_high = 0.2
sg(r*[1 - ε_low < r and r < 1 + ε_high])*A*log(π)
