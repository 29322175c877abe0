"""The TRL adapter: a GRPOTrainer whose policy term is a compiled objective.

    trainer = ObjectiveGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(loss_type="dapo", ...),
                                   train_dataset=..., objective="drpo", objective_params={"delta": 0.2})

The objective replaces TRL's clipped surrogate; everything else in TRL's GRPO loss keeps TRL's
meaning: the normalization GRPOConfig.loss_type names (grpo, bnpo, dr_grpo, dapo), the KL term
(beta), the entropy bonus, the entropy and off-policy masks and the vLLM IS correction. μ is
TRL's old log-probs; π_rollout its sampling log-probs (kept where vLLM generates). The objective is
parsed and compiled at construction, before any model loads. This follows TRL's documented way to
change the objective: a subclass overriding the loss computation (GRPOTrainer._compute_loss)."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from trl import GRPOTrainer

from dsl.parser import Objective
from openrlhf_drpo.core import CompiledLoss

# TRL's loss types that are a normalization (ours then applies), and those that are a formula,
# with the shipped objective that writes it
NORMALIZATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")
FORMULAS = {"cispo": "cispo", "sapo": "sapo", "luspo": "luspo", "vespo": "vespo"}


class TrlObjectiveLoss(CompiledLoss):
    rollout_hint = (": TRL keeps sampling log-probs only where vLLM generates (use_vllm=True); "
                    "without them use an objective on μ (TRL's old log-probs)")


class ObjectiveGRPOTrainer(GRPOTrainer):
    """trl.GRPOTrainer with `objective=` (a shipped name, a path or a dsl.Objective) and
    `objective_params=` (a dict of its parameters, or the options anchor/aggregate); every other
    argument is GRPOTrainer's. Logs drpo_w_mean, drpo_past_boundary_{diverging,converging},
    drpo_abs_pi_minus_mu and drpo_ratio_max beside TRL's metrics."""

    def __init__(self, *args, objective: str | Objective = "drpo", objective_params: Mapping | None = None,
                 **kwargs):
        # first: a bad objective stops with its located error before any model loads
        self.objective_loss = TrlObjectiveLoss(objective, **dict(objective_params or {}))
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is not None:
            _check_config(config, self.objective_loss.objective.name)
        super().__init__(*args, **kwargs)
        _check_config(self.args, self.objective_loss.objective.name)

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _MULTIMODAL})
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        old = per_token_logps.detach() if old is None else old     # num_iterations == 1: μ = π
        sampling = inputs.get("sampling_per_token_logps")

        # TRL's per-token factors on the policy term, by TRL's own helpers
        factor = torch.ones_like(per_token_logps)
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            factor = factor * entropy_mask
        if self.off_policy_mask_threshold is not None:
            factor = factor * self.get_off_policy_mask(advantages, per_token_logps,
                                                       old if sampling is None else sampling, mask,
                                                       self.off_policy_mask_threshold)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            factor = factor * inputs["importance_sampling_ratio"]

        mode = "train" if self.model.training else "eval"
        per_response, norm = self._normalization(mask, inputs, mode)
        weights = factor * per_response
        loss, stats = self.objective_loss(per_token_logps, old, advantages.expand_as(per_token_logps), mask,
                                          rollout_log_probs=sampling, aggregate="token-mean", norm=norm,
                                          weights=weights)
        policy_loss = loss.detach()
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(per_token_logps - old)
            loss = loss + (self.beta * per_token_kl * mask * per_response).sum() / norm
        if self._entropy_bonus_enabled:
            if self.use_adaptive_entropy:
                raise NotImplementedError("ObjectiveGRPOTrainer: the adaptive entropy bonus is not supported; "
                                          "set a fixed entropy_coef")
            effective = mask if entropy_mask is None else mask * entropy_mask
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            entropy = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
            loss = loss - self.entropy_coef * entropy
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        def global_masked_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))
        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))
        for key, value in self.objective_loss.metrics.items():
            self._metrics[mode][key].append(self.accelerator.gather(value.reshape(1)).mean().item())
        return loss

    def _normalization(self, mask, inputs, mode):
        """TRL's normalization for self.loss_type as (per-response factor, normalizer): the loss is
        Σ factor·ℓ over unmasked tokens / normalizer, as GRPOTrainer._compute_loss divides it."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        ones = torch.ones_like(mask[:, :1], dtype=torch.float32)
        if self.loss_type == "grpo":      # each response's mean, then the mean over responses
            return 1 / mask.sum(-1, keepdim=True).clamp(min=1.0), mask.size(0) * accumulation
        if self.loss_type == "bnpo":
            return ones, mask.sum().clamp(min=1.0) * accumulation
        if self.loss_type == "dr_grpo":
            return ones, mask.size(0) * self.max_completion_length * accumulation
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes   # dapo
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return ones, normalizer


_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _check_config(config, name):
    """TRL settings that are themselves a policy term conflict with the objective's."""
    loss_type = getattr(config, "loss_type", "dapo")
    if loss_type in FORMULAS:
        raise ValueError(f"ObjectiveGRPOTrainer: loss_type={loss_type!r} is itself a policy objective, which "
                         f"objective '{name}' replaces; use objective='{FORMULAS[loss_type]}' (objectives/"
                         f"{FORMULAS[loss_type]}.dsl) with loss_type in {list(NORMALIZATIONS)} for its normalization")
    if loss_type not in NORMALIZATIONS:
        raise ValueError(f"ObjectiveGRPOTrainer: unknown loss_type {loss_type!r}; expected one of {list(NORMALIZATIONS)}")
    if getattr(config, "importance_sampling_level", "token") != "token":
        raise ValueError("ObjectiveGRPOTrainer: importance_sampling_level='sequence' is TRL's GSPO policy term; "
                         "use objective='gspo' with importance_sampling_level='token'")
    if getattr(config, "delta", None) is not None:
        raise ValueError("ObjectiveGRPOTrainer: delta (TRL's two-sided clip) is part of TRL's policy term, "
                         "which the objective replaces; write the clip into the objective")
