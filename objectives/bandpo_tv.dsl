# BandPO with the total-variation ball: PPO's clip, its bounds set per token by μ. The band is
# every ratio whose Bernoulli (μ, 1 − μ) stays within TV δ of the old one, capped by π ≤ 1:
# r ∈ [max(0, 1 − δ/μ), min(1/μ, 1 + δ/μ)], so a rare token may rise far more than a likely one.
# Source: "BandPO", arXiv 2603.04918; OpenMOSS/BandPO RLtraining/verl/verl/bandpo/band/band.py
# (bandtv's closed form) and baselinescripts/*/bandpo__grpo_plus_ray_bandtv005.sh: δ = 0.05,
# per-sequence aggregation, r with verl's ±20 clamp, and band()'s own last step: the upper bound
# capped at upper_bound_max, 10 in those runs (band()'s default is 100). Left out, as those runs
# set them: the relaxation toward the fixed clip (does_relax_high_p_bound=false), and the dual
# clip (c = 10), the host's PPO option rather than the band. band() also overrides the bounds
# for μ within 1e-6 of 0 or 1 by their limits; the formula below differs there by under 1e-5.
@aggregate = seq-mean-token-mean
δ = 0.05
lo = max(0, 1 - δ/μ)
u_max = 10
hi = min(1/μ, 1 + δ/μ, u_max)
min(r*A, clip(r, lo, hi)*A)
