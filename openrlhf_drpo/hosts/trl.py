"""The TRL adapter: a GRPOTrainer whose policy term is a compiled objective.

    trainer = ObjectiveGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(loss_type="dapo", ...),
                                   train_dataset=..., objective="drpo", objective_params={"delta": 0.2})

The objective replaces TRL's clipped surrogate; everything else in TRL's GRPO loss keeps TRL's
meaning: the normalization GRPOConfig.loss_type names (grpo, bnpo, dr_grpo, dapo; an objective that
declares another @aggregate is refused, naming the loss_type that aggregates so), the KL term
(beta), the entropy bonus, the entropy and off-policy masks and the vLLM IS correction. μ is
TRL's old log-probs; π_rollout its sampling log-probs (kept where vLLM generates; an objective that
reads π_rollout writes its own train/rollout correction, so TRL's must be off); π_ref its reference
log-probs (beta > 0; the objective's KL then replaces TRL's); H its entropies; group ids its prompt
groups (docs/hosts.md: the settings under which a loss call holds them whole). The objective is
parsed, compiled and checked against the config at construction, before any model loads. This
follows TRL's documented way to change the objective: a subclass overriding the loss computation
(GRPOTrainer._compute_loss), a private method: so the trainer checks, first, that TRL is the
release it re-implements."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from dsl.parser import Objective
from openrlhf_drpo.core import Aggregation, CompiledLoss, turn_ids
from openrlhf_drpo.hosts.trl_config import (AGGREGATES, FORMULAS, MULTIMODAL, NORMALIZATIONS, SUPERSEDED, TRL_VERSION,
                                            check_config, check_trl, not_provided)

# an objective with memory: its state in each checkpoint, beside TRL's own entropy_ctrl_state.json
CONTROL_STATE = "drpo_control_state.json"


class TrlObjectiveLoss(CompiledLoss):
    host = "ObjectiveGRPOTrainer"
    # what _compute_loss passes it, under the settings not_provided checks (it computes no Σ_v π_v²)
    provides = {"rollout_log_probs": "TRL's sampling log-probs (use_vllm=True)",
                "ref_log_probs": "TRL's reference log-probs (beta > 0)",
                "entropy": "TRL's entropies, with their gradient, in every loss call",
                "groups": "TRL's prompt groups (steps_per_generation=1)",
                "turns": "TRL's tool_mask: each run of tool-result tokens ends a turn (no tools: one turn)",
                "staleness": "0: TRL samples each generation batch with the weights its update starts from",
                "batch": "the optimizer step's micro-batches, in no-grad passes over TRL's buffered generation batch "
                         "before the step (gradient_accumulation_steps > 1), summed over the processes",
                "memory": "ObjectiveGRPOTrainer's callback: end_step() after each optimizer step (on_step_end), "
                          "the state in each checkpoint (drpo_control_state.json), restored on resume"}

    def lacks(self, config: GRPOConfig | None) -> dict:
        return not_provided(config)


class ObjectiveGRPOTrainer(GRPOTrainer):
    """trl.GRPOTrainer with `objective=` (a shipped name, a path or a dsl.Objective) and
    `objective_params=` (a dict of its parameters, or the options anchor/aggregate); every other
    argument is GRPOTrainer's. Logs drpo_w_mean, drpo_past_boundary_{diverging,converging},
    drpo_abs_pi_minus_mu and drpo_ratio_max beside TRL's metrics. An objective with memory (a
    controlled parameter or `step`) is updated once after each optimizer step, logs drpo_<name> and
    drpo_step, and is saved with each checkpoint (CONTROL_STATE) and restored on resume."""

    def __init__(self, *args, objective: str | Objective = "drpo", objective_params: Mapping | None = None,
                 **kwargs):
        # first: another TRL, or a bad objective, stops with its error before any model loads
        check_trl()
        if "aggregate" in (objective_params or {}):
            raise ValueError("ObjectiveGRPOTrainer: the aggregation is GRPOConfig.loss_type's normalization, "
                             "not an objective parameter")
        self.objective_loss = TrlObjectiveLoss(objective, **dict(objective_params or {}))
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is not None:
            check_config(config, self.objective_loss)
        super().__init__(*args, **kwargs)
        check_config(self.args, self.objective_loss)     # the default GRPOConfig, where none was given
        self.objective_start = self.objective_loss.control_state()     # None: no memory
        if self.objective_start is not None:
            self.add_callback(_ObjectiveMemory(self))

    def _save_checkpoint(self, model, trial):
        # first, so that the checkpoint TRL then writes (and pushes, where it does) holds it
        state = self.objective_loss.control_state()
        if state is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, CONTROL_STATE), "w") as f:
                json.dump(state, f)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:      # resuming: TrainerState (global_step) is the checkpoint's by now
            _load_memory(self, checkpoint)

    def _generate_and_score_completions(self, inputs):
        """TRL's, plus each row's group id where the objective has a group reduction: TRL's sampler
        repeats each prompt num_generations times in a row and TRL normalizes rewards over
        consecutive blocks of that size of the processes' rows in rank order (rewards.view(-1,
        num_generations)), so a row's group is its global index // num_generations. The ids then
        travel with the rows through TRL's shuffle (shuffle_sequence_dict permutes every tensor)."""
        output = super()._generate_and_score_completions(inputs)
        if "groups" in self.objective_loss.kept_whole:
            rows = output["completion_ids"].size(0)
            size = self.num_generations if self.model.training else self.num_generations_eval
            first = self.accelerator.process_index * rows
            output["groups"] = torch.arange(first, first + rows, device=output["completion_ids"].device) // size
        return output

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        reads = self.objective_loss.inputs()
        # the batch's ranks: TRL's data-parallel processes (accelerate's default process group)
        ranks = torch.distributed.group.WORLD if "batch" in reads and self.accelerator.num_processes > 1 else None
        if "batch" in reads and mode == "train" and self.current_gradient_accumulation_steps > 1:
            ranks = _step_statistics(self, model)
        (loss, metrics), (per_token_logps, entropies, aux_loss, old, mask, per_response, norm, entropy_mask) = \
            _objective_call(self, model, inputs, mode, ranks)
        ref = inputs.get("ref_per_token_logps")
        if self.beta != 0.0:
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(per_token_logps - old)
            # an objective that reads π_ref writes its own KL: beta > 0 only loads the reference
            # model, and TRL's β·KL is logged (kl), not added a second time
            if "ref_log_probs" not in reads:
                loss = loss + (self.beta * per_token_kl * mask * per_response).sum() / norm
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self._entropy_bonus_enabled:     # adaptive: refused at construction
            # TRL's policy_loss: the loss with β·KL, before the accumulation scaling for the loss
            # types that divide by it afterwards (dapo's normalizer already holds it)
            policy_loss = loss.detach() * (accumulation if self.loss_type != "dapo" else 1.0)
            effective = mask if entropy_mask is None else mask * entropy_mask
            entropy = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
            loss = loss - self.entropy_coef * entropy
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        def global_masked_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))
        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))
        # the objective's metrics in one gather, reduced over ranks as TRL reduces its own: a
        # maximum by max (as clip_ratio/high_max), a mean or fraction by the mean of the ranks'
        # (as policy_loss: nanmean); each metric declares which it is (core.METRICS)
        logged = [(i, m) for i, m in enumerate(metrics.fields) if m.key]
        gathered = self.accelerator.gather(metrics.values[[i for i, _ in logged]].float()[None])
        maxima = torch.tensor([m.reduce == "max" for _, m in logged], device=gathered.device)
        for (_, m), value in zip(logged, torch.where(maxima, gathered.amax(0), gathered.nanmean(0)).tolist()):
            self._metrics[mode][m.key].append(value)
        return loss


class _ObjectiveMemory(TrainerCallback):
    """The objective's update, exactly once per optimizer step: Trainer calls on_step_end after
    optimizer.step(), on every process, in training only, before it logs and saves the step, so
    the step's loss calls read the values from before it and the checkpoint holds those after."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # a run that starts at global step 0 (a second train(), auto_find_batch_size's retry after
        # an out-of-memory error) starts from the declared values, not from a state it abandoned
        if state.global_step == 0:
            self.trainer.objective_loss.load_control_state(self.trainer.objective_start)

    def on_step_end(self, args, state, control, **kwargs):
        for key, value in self.trainer.objective_loss.end_step().items():     # all processes: the world
            self.trainer._metrics["train"][key].append(value)


def _load_memory(self, checkpoint):     # self: the ObjectiveGRPOTrainer
    """The objective's state from `checkpoint` (resume_from_checkpoint), refused where it cannot be
    the state of this run at that checkpoint's step."""
    loss, path = self.objective_loss, os.path.join(checkpoint, CONTROL_STATE)
    name, saved = loss.objective.name, os.path.isfile(path)
    if loss.controller is None and saved:
        raise ValueError(f"ObjectiveGRPOTrainer: checkpoint {checkpoint} holds the state of an objective with memory "
                         f"({CONTROL_STATE}), but objective '{name}' has none: resume with the objective it was "
                         f"saved with, or remove {CONTROL_STATE} to drop that state")
    if loss.controller is None:
        return
    if not saved:
        raise ValueError(f"ObjectiveGRPOTrainer: objective '{name}' has memory (its controlled parameters and step), "
                         f"but checkpoint {checkpoint} holds no {CONTROL_STATE}: it was saved by another trainer or "
                         "objective, and resuming would restart the objective's values and step at their declared ones")
    with open(path) as f:
        state = json.load(f)
    # the objective's step counter starts at its declared step (0 unless set) and counts TRL's steps
    expected = self.objective_start["step"] + self.state.global_step
    if state.get("step") != expected:
        raise ValueError(f"ObjectiveGRPOTrainer: {path} holds the objective's state at step {state.get('step')}, but "
                         f"the checkpoint is at global step {self.state.global_step} (the objective's step {expected})")
    loss.load_control_state(state)


def _objective_call(self, model, inputs, mode, ranks):   # self: the ObjectiveGRPOTrainer
    """The policy term of one loss call: the model's forward on `inputs` (a micro-batch), TRL's
    per-token factors and normalization, and the objective's (loss, metrics), with what the rest
    of _compute_loss reads."""
    reads = self.objective_loss.inputs()
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
        model, torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1),
        completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
        **{k: inputs.get(k) for k in MULTIMODAL})
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old     # num_iterations == 1: μ = π
    sampling = inputs.get("sampling_per_token_logps")
    # vLLM marks tokens it could not score NaN: ratio 1 there (TRL zeroes their log-difference);
    # TRL's off-policy mask reads them raw and ignores them itself
    rollout = None if sampling is None else torch.where(torch.isnan(sampling), old, sampling)

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
    if self.use_vllm and self.vllm_importance_sampling_correction:     # an objective on π_rollout: refused
        factor = factor * inputs["importance_sampling_ratio"]

    per_response, norm = _normalization(self, mask, inputs, mode)
    weights = factor * per_response
    ref = inputs.get("ref_per_token_logps")
    loss, metrics = self.objective_loss(per_token_logps, old, advantages.expand_as(per_token_logps), mask,
                                        rollout_log_probs=rollout, ref_log_probs=ref,
                                        entropy=entropies if "entropy" in reads else None,
                                        groups=inputs.get("groups"), **_turns_and_staleness(reads, inputs, mask),
                                        aggregation=Aggregation("token-mean", norm=norm, weights=weights,
                                                                process_group=ranks))
    return (loss, metrics), (per_token_logps, entropies, aux_loss, old, mask, per_response, norm, entropy_mask)

def _step_statistics(self, model):     # self: the ObjectiveGRPOTrainer
    """At an optimizer step's first micro-batch, its batch statistics (core.collectives.BatchStatistics):
    no-grad passes of the model's forward and the loss over the step's micro-batches, TRL's buffered
    slices of its generation batch, summed over the processes; the step's calls read them."""
    left = getattr(self, "_drpo_step_left", 0)
    if left == 0:
        steps, spg = self.current_gradient_accumulation_steps, self.args.steps_per_generation
        first = self._step % spg
        if first + steps > spg:
            raise RuntimeError(f"ObjectiveGRPOTrainer: the optimizer step's micro-batches {first}..{first + steps - 1} "
                               f"are not all in one generation batch of steps_per_generation={spg} slices")
        ranks = torch.distributed.group.WORLD if self.accelerator.num_processes > 1 else None
        stats = self.objective_loss.batch_statistics(ranks)
        for _ in stats.recording():
            with torch.no_grad():
                for j in range(first, first + steps):
                    _objective_call(self, model, self._buffered_inputs[j], "train", stats)
        self._drpo_stats, left = stats, steps
    self._drpo_step_left = left - 1
    return self._drpo_stats


def _normalization(trainer, mask, inputs, mode):
    """TRL's normalization for the trainer's loss_type as (per-response factor, normalizer): the
    loss is Σ factor·ℓ over unmasked tokens / normalizer, as GRPOTrainer._compute_loss divides it."""
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    ones = torch.ones_like(mask[:, :1], dtype=torch.float32)
    if trainer.loss_type == "grpo":      # each response's mean, then the mean over responses
        return 1 / mask.sum(-1, keepdim=True).clamp(min=1.0), mask.size(0) * accumulation
    if trainer.loss_type == "bnpo":
        return ones, mask.sum().clamp(min=1.0) * accumulation
    if trainer.loss_type == "dr_grpo":
        return ones, mask.size(0) * trainer.max_completion_length * accumulation
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes   # dapo
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return ones, normalizer


def _turns_and_staleness(reads, inputs, mask) -> dict:
    """The fourth version's inputs where the objective reads them: turn ids from TRL's tool_mask (0 on
    a tool's or an environment's tokens, 1 elsewhere, padded with 1), and staleness 0 (TRL generates
    synchronously: a batch's policy version is the one its update starts from)."""
    out = {}
    if "turns" in reads:
        out["turns"] = turn_ids(inputs.get("tool_mask", torch.ones_like(mask)))
    if "staleness" in reads:
        out["staleness"] = torch.zeros_like(mask, dtype=torch.float32)
    return out


__all__ = ["AGGREGATES", "CONTROL_STATE", "FORMULAS", "NORMALIZATIONS", "SUPERSEDED", "TRL_VERSION", "ObjectiveGRPOTrainer", "TrlObjectiveLoss"]
