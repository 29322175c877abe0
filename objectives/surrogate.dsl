# Unregularized token-level surrogate (TRPO's importance-sampled objective, no trust region).
# Source: Schulman et al. 2015, "Trust Region Policy Optimization"; the paper's Eq. (tok_is_obj).
r*A
