# LUSPO: GSPO's clipped sequence objective weighted by the response's length, which undoes the
# 1/|y| of the per-sequence mean (long responses are not down-weighted).
# Source: "LUSPO", arXiv 2602.05261; TRL's GRPOTrainer loss_type="luspo" (sequence-level
# importance sampling); ε = 2e-3 below and 2.5e-3 above as the paper's §5.1 (TRL's paper index).
@aggregate = seq-mean-token-mean
ε_low = 2e-3
ε_high = 2.5e-3
s = exp(seq_mean(log(π) - log(μ)))
seq_len*min(s*A, clip(s, 1 - ε_low, 1 + ε_high)*A)
