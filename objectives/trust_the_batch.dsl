# Trust the Batch: P3O's REINFORCE term weighted by the stopped ratio capped at the batch's normalized
# effective sample size (ESS), plus (1 − ESS)·KL(π‖μ). ESS = (Σw)²/(n·Σw²) over the batch's tokens, w = π/μ;
# the KL is the k3 estimator, a regularizer that grows as the batch goes off-policy; no clip hyperparameter.
# Source: Fakoor, Aubry, Stranges, Smola 2026, "Trust the Batch, On- or Off-Policy", arXiv 2605.12380; the
# authors' framework FeynRL (its README cites the paper), algs/P3O/p3o.py (compute_policy_loss,
# calculate_ess) and algs/RL/common.py (compute_kl_distance), commit 4f7eafe, with its defaults: no entropy
# or reference-KL term, a token mean. As there: w from the raw log-ratio, ESS = (Σw)²/((Σw² + 1e-8)·n)
# stop-gradient, the KL's exponent clamped to ±10. Choices: the batch is the optimizer step's (over every
# data-parallel rank); FeynRL's code takes it per micro-batch, which is this where a micro-batch is the
# step. Its fallback to ESS = 1 where a sum is not finite is not written. Locality: batch.
w = exp(log(π) - log(μ))
ess = batch_sum(sg(w))^2/((batch_sum(sg(w)^2) + 1e-8)*batch_count(A))
kl = log(π) - log(μ) + exp(clip(log(μ) - log(π), -10, 10)) - 1
sg(clip(w, 0, ess))*log(π)*A - (1 - ess)*kl
