# Pass@k at k = G (max@G): PPO's clipped objective with every response of a prompt's group credited with the
# group's best advantage, group_max over its responses, the score of max@k's gradient at k = n.
# Source: Walder & Karkhanis 2025, "Pass@K Policy Optimization: Solving Harder Reinforcement Learning Problems",
# arXiv 2505.15201 (PKPO): the unbiased estimator of ∇ max@k from n samples gives sample i the mean of
# max f over the k-subsets holding it, which at k = n is max_j f(x_j) for every sample.
# Choices: k = G, the whole group (k < G takes the order statistics' binomial weights, not in the language);
# f is the host's advantage A, each response read once (seq_mean(A)), so a group-normalized A gives max@G's
# score less the group's mean over its std; no leave-one-out baseline (PKPO's needs k < n); PPO's symmetric
# ε = 0.2, a token mean. The maximum reads fixed inputs only: locality token, but each loss call holds whole groups.
ε = 0.2
best = group_max(seq_mean(A))
min(r*best, clip(r, 1 - ε, 1 + ε)*best)
