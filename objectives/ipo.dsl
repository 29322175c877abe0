# IPO here: the symmetric |π - μ| box. A token's ratio term is dropped once its probability has
# moved more than δ from μ, in either direction and whatever the advantage's sign (DPPO's
# Binary-TV box keeps the moves its advantage does not push).
# Source: the total-variation trust region of Qi et al. 2026, "Rethinking the Trust Region in LLM
# Reinforcement Learning" (DPPO), arXiv 2602.04879, made symmetric; δ = 0.15 as DPPO's.
δ = 0.15
[|π - μ| <= δ]*r*A
