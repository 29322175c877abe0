# SAPO with the error-function gate: f(r) = c/τ·erf(τ(r − 1)), c = √π/2. Its weight
# w(r) = exp(−τ²(r − 1)²) is 1 on policy (c makes it so) and has Gaussian tails, the family's
# fastest decay.
# Source: Denisov et al. 2026, "Smooth Gate Functions for Soft Advantage Policy Optimization",
# arXiv 2602.19345; only its abstract and summaries could be read (no code found): c is the
# paper's normalisation w(1) = 1, and τ = 1.0 for A > 0 and 1.05 otherwise, r with OpenRLHF's
# ±20 log-ratio clamp and per-sequence aggregation are all as sapo.dsl (the paper swaps only
# the gate inside SAPO).
@aggregate = seq-mean-token-mean
τ_pos = 1.0
τ_neg = 1.05
τ = [A > 0]*τ_pos + [A <= 0]*τ_neg
c = sqrt(3.141592653589793)/2
c/τ*erf(τ*(r - 1))*A
