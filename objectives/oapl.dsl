# OAPL: a KL-regularized advantage regression, with no importance ratio. Each response's summed
# log-ratio to the (lagged) rollout policy, scaled by β₂, is regressed on its optimal advantage
# R − V̂*, V̂* = β₁·log mean_group exp(R/β₁) over the prompt's responses; the loss is the squared error per
# response, averaged over the responses.
# Source: Ritter et al. 2026, "LLMs Can Learn to Reason Via Off-Policy RL", arXiv 2602.19362; the formula
# as NVIDIA NeMo-RL implements it (OAPLAdvantageEstimator in nemo_rl/algorithms/advantage_estimator.py,
# OAPLLossFn in nemo_rl/algorithms/loss/loss_functions.py, read from their tests; the paper's equations
# were not reachable): mean_i (β₂·Σ_t (log π − log π_gen) − (R_i − V̂*))², β₁ = 1,
# β₂ = 1e-3 (the tests' values), π_gen the generation log-probs (@anchor = rollout).
# Choices: R is the host's advantage per response (seq_mean(A)): a group-constant shift of A cancels in
# R − V̂*, so raw rewards or mean-centred ones (Dr. GRPO, RLOO's mean) give the same target; a division by
# the group's std does not. V̂* subtracts the group's mean inside the exponential (NeMo-RL's logsumexp
# subtracts the maximum): the same value, finite while a reward stays within 709·β₁ of its group's mean.
# A response with no token has no A to read: it is left out of V̂* and of the mean (NeMo-RL counts its
# reward). Locality: response (V̂* reads only A; still each prompt's responses come whole in one call).
@anchor = rollout
@aggregate = seq-mean-token-mean
β_1 = 1
β_2 = 1e-3
R = seq_mean(A)
v_star = group_mean(R) + β_1*log(group_mean(exp((R - group_mean(R))/β_1)))
-(β_2*seq_sum(log(π) - log(μ)) - (R - v_star))^2
