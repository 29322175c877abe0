# On-policy distillation: minus the forward KL from the teacher (in π_ref's place) to the policy over the
# teacher's top-k plus one tail bucket. Source: verl PR #7855, forward_kl_topk_tail (the tail-aware top-k
# forward KL); k is the host's (drpo-train: --drpo.vocab_topk, the teacher --drpo.teacher).
# ε guards the policy tail's log as verl's tail_mass_eps; the teacher tail is clipped to [0, 1] and
# its own log floored at the smallest fp32 normal, so that a zero tail contributes 0.
ε = 1e-7
P = ref_topk_sum(π_ref_v)
Q = ref_topk_sum(π_v)
tail = clip(1 - P, 0, 1)*(log(max(clip(1 - P, 0, 1), 1.1754943508222875e-38)) - log(clip(1 - Q, ε, 1)))
-(ref_topk_sum(π_ref_v*(log(π_ref_v) - log(π_v))) + tail)
