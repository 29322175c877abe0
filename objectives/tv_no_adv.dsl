# TV regularizer without the advantage weight |A|.
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix D.2 (advantage-weighting ablation).
δ = 12.5
r*A - 1/(2δ)*|r - 1|
