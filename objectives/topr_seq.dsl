# TOPR at the sequence level: the taper is the response's ratio exp(seq_mean(log π − log μ)). The
# response's sign is that of its mean advantage: weight 1 where seq_mean(A) ≥ 0, else
# sg(min(s, 1)) (the ratio from the unclamped log-ratio).
# Source: verl PR #6986, "[algo] feat: add TOPR (Tapered Off-Policy REINFORCE) policy loss" (open);
# read from its tests/trainer/ppo/test_topr_policy_loss_on_cpu.py, as its implementation was not
# found: the weight, its stop-gradient, the unclamped log-ratio and the per-sequence aggregation
# it pins are those tests' own reference.
@aggregate = seq-mean-token-mean
s = exp(seq_mean(log(π) - log(μ)))
[seq_mean(A) >= 0]*A*log(π) + [seq_mean(A) < 0]*sg(min(s, 1))*A*log(π)
