# Seq-MIS: REINFORCE weighted by the response's untruncated importance weight w = Π_t π/π_rollout,
# stopped, the response dropped unless its geometric mean w^(1/T) is in [low, high].
# Source: prime-rl PR #3384, "add Geo-Mask, Seq-TIS, Seq-MIS and MIS-PO loss types" (open), after Li's
# "RL collapse, part 3" and Huang. Its seq_mis formula: −Σ I(low ≤ w^(1/T) ≤ high)·w·A·log π.
# The PR's defaults and code were not reachable: [0.1, 10] is this library's choice, prime-rl's own
# earlier geo_mask_low and geo_mask_high (PR #1404). The global token count as the PR's other types.
@anchor = rollout
low = 0.1
high = 10
x = log(π) - log(μ)
g = exp(seq_mean(x))
[low <= g and g <= high]*sg(exp(seq_sum(x)))*A*log(π)
