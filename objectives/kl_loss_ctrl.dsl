# A controller on the KL loss's coefficient: PPO's clipped ratio minus β·k3(π‖π_ref), β moved after
# each optimizer step by β ← β·(1 + clip(kl/kl_target − 1, −0.2, 0.2)·steps/horizon), clamped at 0,
# kl the step's mean of the KL loss itself.
# Source: miles pull request #3222 (open), "loss: add an adaptive KL controller (--kl-ctrl adaptive)":
# --kl-target 0.1, --kl-horizon 10000, --kl-ctrl-steps 1, applied after every optimizer step to the
# reduced kl_loss; its k3 is miles' low_var_kl, clamped to [−10, 10]. The upper bound is this file's.
ε_low = 0.2
ε_high = 0.2
kl_target = 0.1
horizon = 10000
steps = 1
β = 0.001
# k3 from the log-ratio x, as miles computes it: written π_ref/π − log(π_ref/π), the quotient
# overflows past |x| ≈ 709 and the loss was inf − inf, a NaN (tests/test_numerics.py's far batch)
x = log(π_ref) - log(π)
k3 = clip(exp(x) - x - 1, -10, 10)
β ← β·(1 + clip(batch_mean(k3)/kl_target - 1, -0.2, 0.2)·steps/horizon) in [0, 10]
min(r*A, clip(r, 1 - ε_low, 1 + ε_high)*A) - β·k3
