# Mask-KL: the squared-log (online mirror descent, as in Kimi) penalty applied only outside
# DPPO's Binary-TV trust region.
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix D.6, Eq. (mask_kl_objective).
δ_tv = 0.15
δ = 12.5
M_out = [|π - μ| > δ_tv]
r*A - M_out*|A|/(2δ)*log(r)^2/2
