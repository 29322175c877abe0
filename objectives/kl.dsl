# Advantage-weighted KL regularizer (K1 estimator of KL(μ‖π)).
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix C, Eq. (kl_penalty).
δ = 12.5
r*A + |A|/(2δ)*log(r)
