# μ-GRPO: GRPO with relaxed clipping and the negative-advantage veto; in a response with A < 0, the tokens
# after its first trigger (a token whose ratio to the behaviour policy is below κ) that are not triggers
# themselves (the harmful set H_κ = S_κ \ T) are masked.
# Source: Tian, Xie and Wei 2026, "How Off-Policy Can GRPO Be? μ-GRPO for Efficient LLM Reinforcement
# Learning", arXiv 2605.17570, its project page (the paper past its abstract and code were not
# reachable). From the page: the relaxed clip [0, 5] (its diagnostics' bound: ε_low = 1, ε_high = 4), the
# trigger (a token of a negative-advantage response whose ratio π_θ/π_behav is extremely small), the
# veto of H_κ for A < 0, and the behaviour policy as the stored rollout log-probs (@anchor = rollout). Ours,
# not the authors': κ = 1e-4 (the page's illustration shows a trigger below 10⁻⁴; no threshold is
# published), the token-mean aggregation, and the response's advantage read as its tokens' mean (GRPO's
# one value per response; a host with per-token advantages gives their mean).
@anchor = rollout
κ = 1e-4
ε_low = 1
ε_high = 4
harmful = seq_mean(A) < 0 and r >= κ and prefix_sum([r < κ]) > 0
[not harmful]*min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
