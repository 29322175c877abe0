# Mask-DRPO: the DRPO penalty applied only outside DPPO's Binary-TV trust region.
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix D.6, Eq. (mask_drpo_objective).
# The paper writes one δ; here the mask threshold (DPPO's 0.15) and the penalty scale
# (DRPO's 12.5) are separate parameters so each keeps its tuned value.
δ_tv = 0.15
δ = 12.5
M_out = [|π - μ| > δ_tv]
r*A - M_out*|A|/(2δ)*μ*(r - 1)^2
