"""The host-neutral loss core: a compiled objective as a torch loss, knowing no training framework
(it imports torch, numpy, sympy and lark only).

    loss_fn = CompiledLoss("drpo", delta=0.2)     # shipped name, path or dsl.Objective
    loss, metrics = loss_fn(log_probs, old_log_probs, advantages, mask)
    loss.backward(); metrics.floats()             # {"drpo_w_mean": ..., ...}: one host sync

loss (CompiledLoss and its compile cache), values (Aggregation, TokenBatch: a call's tensors, checked
once; Generated: a compiled objective; LossMetrics, METRICS), kernels (the fused kernels and their
autograd Function), boundary (the inputs' checks)."""
from openrlhf_drpo.core.boundary import check_inputs, turn_ids
from openrlhf_drpo.core.loss import CompiledLoss
from openrlhf_drpo.core.values import (FILTERED, METRIC_KEYS, METRICS, Aggregation, Generated, LossMetrics, LossOutput,
                                      Metric, TokenBatch)

__all__ = ["Aggregation", "CompiledLoss", "FILTERED", "Generated", "LossMetrics", "LossOutput", "METRICS",
           "METRIC_KEYS", "Metric", "TokenBatch", "check_inputs", "turn_ids"]
