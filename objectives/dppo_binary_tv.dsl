# DPPO with the Binary-TV divergence: mask a token once it has moved more than δ in
# absolute probability in the direction its advantage pushes it.
# Source: the DPPO paper (Divergence Proximal Policy Optimization); the paper's Eq. (dppo_obj),
# δ = 0.15 as tuned in its Appendix D.
δ = 0.15
D = |π - μ|
[A*(r - 1) <= 0 or D <= δ]*r*A
