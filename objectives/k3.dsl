# Advantage-weighted KL regularizer with the K3 estimator r - 1 - log r.
# Source: "Rethinking the Divergence Regularization in LLM RL", Appendix C, Eq. (k3_penalty).
δ = 12.5
r*A - |A|/(2δ)*(r - 1 - log(r))
