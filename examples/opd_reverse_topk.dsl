# On-policy distillation: minus the reverse KL from the policy to the teacher (in π_ref's place) over
# the policy's own top-k, as verl's reverse_kl_topk (verl #7590) computes it (no tail bucket).
-topk_sum(π_v*(log(π_v) - log(π_ref_v)))
