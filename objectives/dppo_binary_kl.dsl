# DPPO with the Binary-KL divergence: KL(μ‖π) between Bernoulli(μ) and Bernoulli(π) of the
# sampled token. Source: the DPPO paper (Divergence Proximal Policy Optimization); the
# paper's Eq. (dppo_obj) with D = D_KL.
δ = 0.05
D = μ*log(μ/π) + (1 - μ)*log((1 - μ)/(1 - π))
[A*(r - 1) <= 0 or D <= δ]*r*A
