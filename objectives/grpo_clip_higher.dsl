# GRPO with clip-higher: a looser upper clip keeps exploration on positive-advantage tokens.
# Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale".
ε_low = 0.2
ε_high = 0.28
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
