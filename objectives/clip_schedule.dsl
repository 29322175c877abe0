# PPO with an annealed clip range: ε falls linearly from 0.1 at the first step to 0 at step `total`.
# Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347, Table 5
# (Atari: clipping parameter 0.1·α, α annealed linearly from 1 to 0 over training); OpenAI baselines
# ppo2 (ppo2.py: cliprangenow = cliprange(frac), frac = 1 − (update − 1)/nupdates, update from 1),
# which is 1 − step/total with step counted from 0.
total = 10000
ε = 0.1·max(1 - step/total, 0)
min(r*A, clip(r, 1 - ε, 1 + ε)*A)
