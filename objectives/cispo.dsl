# CISPO: clip the (stopped) importance-sampling weight instead of the token's update, so
# every token keeps a gradient. Source: MiniMax 2025, "MiniMax-M1: Scaling Test-Time
# Compute Efficiently with Lightning Attention" (no lower clip; ε_high as clip-higher).
ε_high = 0.28
sg(min(r, 1 + ε_high))*A*log(π)
