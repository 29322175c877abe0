# DRO (Kimi k1.5's policy mirror descent): REINFORCE plus a squared log-ratio penalty towards μ.
# Source: Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning with LLMs", arXiv 2501.12599,
# §2.3.2; the per-token form A·log π − τ/2·(log π − log μ)² as verl's compute_policy_loss_dro.
# τ is not published by Kimi; 0.05 is the value Tinker's documentation uses.
τ = 0.05
A*log(π) - τ/2*(log(π) - log(μ))^2
