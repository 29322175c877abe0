# Entropy bonus: PPO's clipped ratio plus c·H, H the policy's entropy at the token. H's own gradient
# (c per unit of aggregation weight) flows back through the host's entropy tensor.
# Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347, Eq. (9)
# (L^CLIP + c₂·S[π], the value-function term left to the host); c = 0.01 (the paper's Atari c₂), ε = 0.2.
# The same bonus is OpenRLHF's --actor.entropy_coef (trainer/ray/ppo_actor.py), verl's entropy_coeff and
# TRL's entropy_coef, each off by default; like verl's and OpenRLHF's, it is aggregated with the policy
# term (token mean here).
ε_low = 0.2
ε_high = 0.2
c = 0.01
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) + c*H
