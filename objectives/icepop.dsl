# IcePop: keep a token only while its train/rollout ratio k = π_old/π_rollout is in [α, β];
# survivors keep k as their weight on PPO's clipped objective.
# Source: Ling Team 2025, "IcePop" (ringtech.notion.site/icepop; Ring-1T, arXiv 2510.18855);
# α = 0.5, β = 5 as verl's decoupled_token_icepop and OpenRLHF's is_correction_threshold.
ε_low = 0.2
ε_high = 0.2
α = 0.5
β = 5
k = exp(log(π_old) - log(π_rollout))
[α <= k and k <= β]*k*min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A)
