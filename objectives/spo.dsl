# SPO: Simple Policy Optimization, a smooth quadratic in place of the ratio clip.
# Source: Xie et al. 2025, "Simple Policy Optimization"; the paper's Eq. (spo_obj).
ε = 0.2
r*A - |A|/(2ε)*(r - 1)^2
