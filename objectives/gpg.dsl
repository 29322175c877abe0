# GPG: Group Policy Gradient. Plain REINFORCE on the log-probability, no ratio and no clip.
# Source: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
# Reasoning", arXiv 2504.02546 (verl's compute_policy_loss_gpg); token-mean.
A*log(π)
