# SAPO with the error-function gate: f(r) = c/τ·erf(τ(r − 1)), c = √π/2 so that the weight
# w(r) = exp(−τ²(r − 1)²) is 1 on policy; Gaussian tails, the fastest-decaying gate of the family.
# Source: Denisov et al. 2026, "Smooth Gate Functions for Soft Advantage Policy Optimization",
# arXiv 2602.19345 (its code was not found; the gate and c are the paper's admissibility
# conditions: odd, increasing, w(1) = 1). τ = 1.0 for A > 0 and 1.05 otherwise, r with
# OpenRLHF's ±20 log-ratio clamp and per-sequence aggregation, all as sapo.dsl (the paper
# swaps only the gate inside SAPO).
@aggregate = seq-mean-token-mean
τ_pos = 1.0
τ_neg = 1.05
τ = [A > 0]*τ_pos + [A <= 0]*τ_neg
c = sqrt(3.141592653589793)/2
c/τ*erf(τ*(r - 1))*A
