# BandPO with the Pearson χ² ball: the bounds r = 1 ∓ sqrt(δ(1 − μ)/μ), clamped to [0, 1/μ].
# As bandpo_tv, PPO's clip with the band's bounds: the ratios whose Bernoulli stays within χ² δ of
# (μ, 1 − μ).
# Source: "BandPO", arXiv 2603.04918; OpenMOSS/BandPO RLtraining/verl/verl/bandpo/band/band.py
# (bandchi2's closed form) and baselinescripts/*/bandpo__grpo_plus_ray_bandchi2005.sh: δ = 0.05,
# per-sequence aggregation, r with verl's ±20 clamp, and as bandpo_tv the upper bound capped at
# 10 (band()'s upper_bound_max in those runs); the dual clip (c = 10), a host option, left out.
@aggregate = seq-mean-token-mean
δ = 0.05
d = sqrt(δ*(1 - μ)/μ)
lo = max(0, 1 - d)
u_max = 10
hi = min(1/μ, 1 + d, u_max)
min(r*A, clip(r, lo, hi)*A)
