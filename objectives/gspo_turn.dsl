# GSPO per turn: GSPO's sequence ratio taken over each turn of a multi-turn agent episode, the
# geometric mean of the turn's token ratios, clipped as GSPO clips a response's; each token of a turn
# gets its turn's gradient, and the tool or environment tokens between turns (masked) none.
# Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, Eqs. (5)-(7),
# the response's ratio taken per turn (NeMo-RL #2269); clip 3e-4 and 4e-4 and aggregation as gspo.dsl.
@aggregate = seq-mean-token-mean
ε_low = 3e-4
ε_high = 4e-4
s = exp(turn_mean(log(π) - log(μ)))
min(s*A, clip(s, 1 - ε_low, 1 + ε_high)*A)
