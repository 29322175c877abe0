# CPPO (Binary-TV): DPPO's mask with a position-weighted threshold and a cumulative prefix budget; a
# token is kept where its advantage pulls it back toward μ, or where its weighted divergence Z_t = w_t·|π − μ|
# is within min(δ, δ + δ_b'·W_{t−1} − S_{t−1}), the exclusive prefix sums of w and Z, and its loss is −A·r.
# Source: Tencent-Hunyuan/UniRL unirl/algorithms/cppo.py (PR #58, merged), _cppo_mask and _cppo_loss,
# "Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning", arXiv 2606.10968, Eqs. 8-11
# (also verl PR #6731, open). UniRL's defaults: δ = 0.2, w_min = 0.8, δ_b = 0.02, the budget
# δ_b' = clamp(torch.quantile(D, 0.9), δ_b, 2δ_b) over the response, token-mean aggregation, μ the
# rollout's log-probs (old_logp_source = "rollout"). Choices: w_t's positions count the response's
# unmasked tokens (UniRL's its packed tokens: the same where no token inside a response is masked);
# the mask is computed in the loss's dtype (UniRL's in float32). UniRL's old_logp_source = "replay" (the
# anchor recomputed before the updates) is @anchor = old.
@anchor = rollout
δ = 0.2
w_min = 0.8
δ_b = 0.02
q = 0.9
D = |π - μ|
w = 1 - (1 - w_min)*(prefix_sum(1) - 1)/max(seq_len - 1, 1)
Z = w*D
S = prefix_sum(Z) - Z
W = prefix_sum(w) - w
budget = clip(seq_quantile(D, q), δ_b, 2*δ_b)
[A*(r - 1) <= 0 or Z <= min(δ, δ + budget*W - S)]*r*A
