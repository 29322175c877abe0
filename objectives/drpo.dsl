# DRPO: Divergence Regularized Policy Optimization
# Source: "Rethinking the Divergence Regularization in LLM RL", Eq. (our_objective_mc); δ = 12.5 as in the paper.
δ = 12.5
r*A - |A|/(2δ)*μ*(r-1)^2
