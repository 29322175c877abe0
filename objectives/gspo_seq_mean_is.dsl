# GSPO with NeMo-RL's sequence-mean importance weight: GSPO's clipped sequence ratio, each response
# weighted by exp of its mean train/rollout log-ratio, log π_old − log π_rollout, truncated at C.
# Source: NeMo-RL PR #2269, "decouple IS correction level from GSPO policy ratio" (open), its
# is_correction_level = sequence_mean. The mean replaces exp(sum), which collapsed on long responses, in
# ClippedPGLossFn (nemo_rl/algorithms/loss/loss_functions.py, 7ea279a) with
# sequence_level_importance_ratios and token_level_loss = false (its GSPO recipe, ε = 0.2, no KL),
# use_importance_sampling_correction and truncated_importance_sampling_type = tis at 2.0, as the PR's
# reproduction runs it. The ratio is the raw exp(log π − log π_old), unclamped, as NeMo-RL computes it.
# Both means are exact: NeMo-RL's masked_mean divides by n + 1e-8, a relative difference below 1e-8/n.
@aggregate = seq-mean-token-mean
ε_low = 0.2
ε_high = 0.2
C = 2
s = exp(seq_mean(log(π) - log(π_old)))
w = clip(exp(seq_mean(log(π_old) - log(π_rollout))), 0, C)
w*min(s*A, clip(s, 1 - ε_low, 1 + ε_high)*A)
