# Dual-clip PPO: for A < 0 the objective is also bounded below by c·A, so a huge ratio
# cannot produce an unbounded update. Source: Ye et al. 2020, "Mastering Complex Control
# in MOBA Games with Deep Reinforcement Learning" (c = 3, as OpenRLHF's dual_clip).
ε_low = 0.2
ε_high = 0.2
c = 3
L = min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
[A >= 0]*L + [A < 0]*max(L, c*A)
