# Seq-TIS: REINFORCE weighted by the response's importance weight against the rollout policy, the product
# of its token ratios, stopped and truncated at C: every response keeps a (possibly damped) gradient.
# Source: prime-rl PR #3384, "add Geo-Mask, Seq-TIS, Seq-MIS and MIS-PO loss types" (open), after Huang's
# "Is Frontier Asynchronous RL Solved?". Its w = Π_t π/π_rollout from the summed log-ratio, the loss
# −Σ min(w, C)·A·log π with the weight detached, over the global token count; seq_clip C = 2 and
# adv_tau = 1 as the PR's defaults. The PR's code was not reachable (it postdates the mirrored
# repository): the log-ratio sum is written unclamped, as the PR's formula.
@anchor = rollout
C = 2
sg(min(exp(seq_sum(log(π) - log(μ))), C))*A*log(π)
