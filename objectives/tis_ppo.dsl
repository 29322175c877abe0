# TIS: PPO's clipped objective times the truncated importance weight min(π_old/π_rollout, C),
# which corrects for the rollout engine sampling from a slightly different policy.
# Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
# Training" (fengyao.notion.site/off-policy-rl); C = 2 as verl PR #2953 and slime's --tis-clip.
ε_low = 0.2
ε_high = 0.2
C = 2
min(exp(log(π_old) - log(π_rollout)), C)*min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
