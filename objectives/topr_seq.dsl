# TOPR, sequence level: as topr, the taper now the response's length-normalised ratio
# s = exp(seq_mean(log π − log μ)), and the response's sign the sign of its mean advantage.
# Source: verl PR #6986 ("[algo] feat: add TOPR (Tapered Off-Policy REINFORCE) policy loss",
# open; read from its tests/trainer/ppo/test_topr_policy_loss_on_cpu.py, its implementation was
# not found): weight 1 where seq_mean(A) ≥ 0, else sg(clip(s, 0, 1)); the ratio from the
# unclamped log-ratio, as those tests compute it; per-sequence aggregation, which it pins.
@aggregate = seq-mean-token-mean
s = exp(seq_mean(log(π) - log(μ)))
[seq_mean(A) >= 0]*A*log(π) + [seq_mean(A) < 0]*sg(min(s, 1))*A*log(π)
