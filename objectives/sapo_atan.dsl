# SAPO with the arctangent gate: f(r) = 1/τ·atan(τ(r − 1)). Its weight w(r) = 1/(1 + τ²(r − 1)²)
# is 1 on policy and decays only polynomially, so far-off tokens keep some gradient.
# Source: Denisov et al. 2026, "Smooth Gate Functions for Soft Advantage Policy Optimization",
# arXiv 2602.19345; only its abstract and summaries could be read (no code found): c = 1 is the
# paper's normalisation w(1) = 1, and τ = 1.0 for A > 0 and 1.05 otherwise, r with OpenRLHF's
# ±20 log-ratio clamp and per-sequence aggregation are all as sapo.dsl.
@aggregate = seq-mean-token-mean
τ_pos = 1.0
τ_neg = 1.05
τ = [A > 0]*τ_pos + [A <= 0]*τ_neg
1/τ*atan(τ*(r - 1))*A
