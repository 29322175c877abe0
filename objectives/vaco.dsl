# VACO: PPO, a response dropped while its mean binary total variation |π_old − π_rollout| exceeds δ.
# The lag is measured on the sampled tokens, the mean over the response's tokens.
# Source: Honari et al. 2026, "Align and Filter: Improving Performance in Asynchronous On-Policy
# RL" (VACO), arXiv 2603.01365; only its abstract and summaries could be read (no code found),
# so the form is the issue's and these are choices: the divergence binary TV (the "total
# Variation" of its name); δ = 0.25, a loose gate that drops only a response whose tokens moved
# a quarter of probability on average (DPPO's per-token 0.15 would drop most responses of a
# 2.5x train/rollout mismatch); PPO with ε = 0.2 for the survivors; token-mean aggregation. Its
# advantage realignment (V-trace) acts on the advantages, outside the objective.
ε_low = 0.2
ε_high = 0.2
δ = 0.25
lag = seq_mean(|π_old - π_rollout|)
[lag <= δ]*min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
