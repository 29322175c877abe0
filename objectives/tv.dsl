# Advantage-weighted TV regularizer (sampled |r - 1|).
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix C, Eq. (tv_penalty).
δ = 12.5
r*A - |A|/(2δ)*|r - 1|
