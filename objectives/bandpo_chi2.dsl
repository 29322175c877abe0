# BandPO with the Pearson χ² ball: as bandpo_tv, the band now the ratios whose Bernoulli stays
# within χ² δ of (μ, 1 − μ): r = 1 ∓ sqrt(δ(1 − μ)/μ), clamped to [0, 1/μ] (π ≤ 1).
# Source: "BandPO", arXiv 2603.04918; OpenMOSS/BandPO RLtraining/verl/verl/bandpo/band/band.py
# (bandchi2's closed form) and baselinescripts/*/bandpo__grpo_plus_ray_bandchi2005.sh: δ = 0.05,
# per-sequence aggregation. As bandpo_tv, the runs' cap of 10 on the upper bound and their
# dual clip (c = 10) are host options left out. δ(1 − μ)/μ is spelled δ(1/μ − 1), the same
# number: SymPy settles the clip's cases within its time limit only in that spelling.
@aggregate = seq-mean-token-mean
δ = 0.05
d = sqrt(δ*(1/μ - 1))
lo = max(0, 1 - d)
hi = min(1/μ, 1 + d)
min(r*A, clip(r, lo, hi)*A)
