# KL regularizer without the advantage weight |A| (TRPO Alg. 1 / PPO Eq. 8 style penalty).
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix D.1 (KL_wo_A), δ = 12.5.
δ = 12.5
r*A + 1/(2δ)*log(r)
