# Mask-SPO: the SPO penalty applied only outside DPPO's Binary-TV trust region.
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix D.6, Eq. (mask_spo_objective).
# Mask threshold δ_tv (DPPO's 0.15) and SPO's ε = 0.2 are separate parameters.
δ_tv = 0.15
ε = 0.2
M_out = [|π - μ| > δ_tv]
r*A - M_out*|A|/(2ε)*(r - 1)^2
