# Geo-Mask: plain REINFORCE on the responses whose geometric-mean ratio against the rollout policy,
# exp(mean of log π − log π_rollout), is in [low, high]; a pure filter, no importance weight.
# Source: prime-rl PR #3384, "add Geo-Mask, Seq-TIS, Seq-MIS and MIS-PO loss types" (open), "Li's
# pure-filter estimator" (Li, "RL collapse, part 3"). Only the PR description's summary was reachable:
# the form is read from it (the three types share the rollout's log-ratio and a detached score-function
# surrogate; geo_mask filters and weighs nothing), and [0.1, 10] is this library's choice, prime-rl's
# own earlier geo_mask_low and geo_mask_high (PR #1404).
@anchor = rollout
low = 0.1
high = 10
g = exp(seq_mean(log(π) - log(μ)))
[low <= g and g <= high]*A*log(π)
