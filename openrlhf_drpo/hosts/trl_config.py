"""TRL 1.16.0's settings against an objective, before any model loads (hosts.trl's construction):
the release whose private GRPOTrainer._compute_loss hosts.trl re-implements, the loss_types that
are a normalization or a formula, the settings the objective supersedes, and each input TRL does
not give under a config (TrlObjectiveLoss.lacks)."""
from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version

from trl import GRPOTrainer

from dsl.printing import render
from openrlhf_drpo.core.loss import refuse_unprovided

# TRL's loss types that are a normalization (ours then applies), and those that are a formula:
# (the shipped objective that writes it, the loss_type whose normalization TRL applies to it).
# luspo: TRL's Σ_t ℓ·mask summed per response, averaged over responses, is grpo's per-response mean
# of luspo.dsl's seq_len·ℓ (TRL's luspo with importance_sampling_level='sequence'; test_trl checks it)
NORMALIZATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")
# Each normalization as the @aggregate it is (TRL 1.16.0 GRPOTrainer._compute_loss): grpo each response's
# mean, then their mean; bnpo and dapo the token sum over the local or the global token count; dr_grpo
# the token sum over responses × max_completion_length (verl's seq-mean-token-sum-norm at that horizon).
# An objective that declares another @aggregate is refused: TRL's normalization would replace it.
AGGREGATES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
              "dr_grpo": "seq-mean-token-sum-norm"}
FORMULAS = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"), "luspo": ("luspo", "grpo"),
            "vespo": ("vespo", "dapo")}

# GRPOConfig settings that only TRL's clipped policy term reads (GRPOTrainer._compute_loss), which
# the objective replaces: setting → (TRL 1.16.0's default, the objective's equivalent at the value
# set). Refused at construction when not the default: TRL would ignore them without a word.
SUPERSEDED = {
    "epsilon": (0.2, "the objective's clip parameters, objective_params={{'eps_low': {0}, 'eps_high': {0}}} "
                     "(ppo, grpo_clip_higher)"),
    "epsilon_high": (None, "the objective's upper clip, objective_params={{'eps_high': {0}}} (ppo, grpo_clip_higher)"),
    "delta": (None, "TRL's two-sided clip written in the objective: δ = {0}, min(min(r, δ)*A, "
                    "clip(r, 1 - ε_low, 1 + ε_high)*A)"),
    "importance_sampling_level": ("token", "objective='gspo' (the sequence ratio, its ε_low and ε_high)"),
}

TRL_VERSION = "1.16.0"
MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
              "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
# the private GRPOTrainer methods hosts.trl overrides or calls, with TRL 1.16.0's parameters
TRL_METHODS = {
    "_compute_loss": ["self", "model", "inputs"],
    "_get_per_token_logps_and_entropies": ["self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                           "batch_size", "compute_entropy", "compute_aux_loss", *MULTIMODAL],
    "get_high_entropy_mask": ["self", "entropies", "mask", "threshold"],
    "get_off_policy_mask": ["advantages", "per_token_logps", "sampling_per_token_logps", "mask",
                            "off_policy_threshold"],
    "_generate_and_score_completions": ["self", "inputs"],
}


def check_trl():
    """The installed TRL is the release whose private _compute_loss hosts.trl re-implements,
    and the private methods it calls take the parameters it passes. The pin is the check: a
    fingerprint of TRL's _compute_loss source would add only a patched 1.16.0, which
    tests/test_trl.py holds to TRL's own loss step by step anyway."""
    try:
        installed = version("trl")
    except PackageNotFoundError:
        installed = "(of unknown version: no package metadata)"
    if installed != TRL_VERSION:
        raise RuntimeError(f"ObjectiveGRPOTrainer: trl {installed} is installed; it is built against "
                           f"trl=={TRL_VERSION}, whose private GRPOTrainer._compute_loss it re-implements (TRL "
                           f"changes a private method between releases without notice): pip install trl=={TRL_VERSION}")
    for name, expected in TRL_METHODS.items():
        params = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)
        if params != expected:
            raise RuntimeError(f"ObjectiveGRPOTrainer: trl's GRPOTrainer.{name} takes {params}, expected "
                               f"{expected} (trl {TRL_VERSION}'s)")


def check_config(config, objective_loss):
    """The config against the objective, before training: TRL settings that are themselves a
    policy term or a train/rollout correction conflict with the objective's, and what the
    objective needs must be there."""
    name = objective_loss.objective.name
    loss_type = getattr(config, "loss_type", "dapo")
    if loss_type in FORMULAS:
        shipped, normalization = FORMULAS[loss_type]
        raise ValueError(f"ObjectiveGRPOTrainer: loss_type={loss_type!r} is itself a policy objective, which "
                         f"objective '{name}' replaces; for TRL's {loss_type} use objective='{shipped}' with "
                         f"loss_type='{normalization}' (objectives/{shipped}.dsl; TRL normalizes its {loss_type} "
                         f"as {normalization})" + (", and importance_sampling_level='token' (the objective "
                                                   "writes the sequence ratio)" if loss_type == "luspo" else ""))
    if loss_type not in NORMALIZATIONS:
        raise ValueError(f"ObjectiveGRPOTrainer: unknown loss_type {loss_type!r}; expected one of {list(NORMALIZATIONS)}")
    _refuse_aggregate(objective_loss.objective, loss_type)
    superseded = {key: getattr(config, key, default) for key, (default, _) in SUPERSEDED.items()
                  if getattr(config, key, default) != default}
    if superseded:
        raise ValueError(f"ObjectiveGRPOTrainer: {', '.join(f'{k}={v!r}' for k, v in superseded.items())}: TRL's "
                         f"policy term reads {'these' if len(superseded) > 1 else 'this'}, and objective '{name}' "
                         "replaces that term: " + ("they" if len(superseded) > 1 else "it") + " would have no "
                         "effect; leave " + ", ".join(f"{k}={SUPERSEDED[k][0]!r}" for k in superseded) + ". In the "
                         "objective: " + "; ".join(f"{k}: {SUPERSEDED[k][1].format(v)}" for k, v in superseded.items()))
    # TRL's controller is a second one beside an objective's memory, updated inside the loss call
    # (not after the step) and saved apart from it: the objective writes it instead
    if getattr(config, "use_adaptive_entropy", False):
        raise ValueError("ObjectiveGRPOTrainer: the adaptive entropy bonus (use_adaptive_entropy=True) is not "
                         "supported: its controller would run beside the objective's "
                         + ("own memory (a second controller)" if objective_loss.controller is not None else "terms")
                         + "; set use_adaptive_entropy=False and write it in the objective: objective="
                         "'adaptive_entropy' (objectives/adaptive_entropy.dsl) is TRL's, step by step")
    refuse_unprovided(objective_loss, config)
    if objective_loss.uses_rollout and getattr(config, "vllm_importance_sampling_correction", False):
        raise ValueError(f"ObjectiveGRPOTrainer: objective '{name}' uses {objective_loss.inputs()['rollout_log_probs']} "
                         "and writes its own train/rollout correction, which TRL's vLLM importance-sampling "
                         "correction would apply a second time; set vllm_importance_sampling_correction=False")
    # an objective that reads H writes its own entropy terms: TRL's bonus on top would count one twice
    if "entropy" in objective_loss.inputs() and getattr(config, "entropy_coef", 0.0):
        raise ValueError(f"ObjectiveGRPOTrainer: objective '{name}' reads the entropy H and writes its own entropy "
                         f"terms, to which TRL's entropy_coef={config.entropy_coef} would add a second bonus; set "
                         "entropy_coef=0.0 and write the bonus into the objective (e.g. + 0.01*H)")
    # an objective with its own entropy quantile (top_entropy) masks as top_entropy_quantile does: twice
    quantiles = [n for n in objective_loss.objective.expr.walk() if n.op == "batch_quantile" and "H" in {
        m.value for m in n.args[0].walk() if m.op == "var"}]
    if quantiles and getattr(config, "top_entropy_quantile", 1.0) < 1.0:
        raise ValueError(f"ObjectiveGRPOTrainer: objective '{name}' writes its own entropy mask "
                         f"({render(quantiles[0])}), on which TRL's top_entropy_quantile="
                         f"{config.top_entropy_quantile} would mask a second time; set top_entropy_quantile=1.0")


def _refuse_aggregate(objective, loss_type) -> None:
    """An objective that declares @aggregate is trained only under a loss_type that aggregates so
    (AGGREGATES); one that declares none takes loss_type's normalization (docs/hosts.md)."""
    declared = objective.options["aggregate"] if "aggregate" in objective.declared else None
    if declared is None or AGGREGATES[loss_type] == declared:
        return
    matching = [t for t, a in AGGREGATES.items() if a == declared]
    fix = (f"set loss_type={' or '.join(map(repr, matching))}, which aggregates so" if matching else
           "no TRL loss_type aggregates so (luspo sums each response's tokens, but is itself a policy objective): "
           f"train it under verl (actor_rollout_ref.actor.loss_agg_mode={declared}) or drop the line to take "
           f"loss_type's")
    raise ValueError(f"ObjectiveGRPOTrainer: objective '{objective.name}' declares @aggregate = {declared}, but "
                     f"loss_type={loss_type!r} aggregates as {AGGREGATES[loss_type]} and TRL's normalization would "
                     f"replace the objective's: {fix}")


def not_provided(config) -> dict:
    """TrlObjectiveLoss.lacks (hosts.trl): each input (CompiledLoss.inputs()) that TRL 1.16.0 does not give under
    `config` (None: under any), with the setting that gives it. H is always there: GRPOTrainer
    computes the entropies, with their gradient, in every loss call. Groups: TRL shuffles a
    generation batch's rows, then slices it into steps_per_generation loss calls, so a call holds
    whole groups only where it is the whole local generation batch and that holds whole groups."""
    out = {"sum_pi_sq": ("TRL's GRPOTrainer computes no Σ_v π_v² (its fused LM head gives log-probs and "
                         "entropies only); write the objective without sum_π_sq"),
           **dict.fromkeys(("vocab_log_probs", "vocab_ref_log_probs"), (
               "TRL's GRPOTrainer gives its loss the sampled token's log-probs and entropies only (its LM head "
               "keeps no logits over the vocabulary, and it has no teacher's top-k); write the objective without "
               "a vocabulary sum"))}
    if config is None:
        return out
    if not getattr(config, "use_vllm", False):
        out["rollout_log_probs"] = ("use_vllm=False: TRL keeps sampling log-probs only where vLLM generates "
                                    "(use_vllm=True); without them use an objective on μ (TRL's old log-probs)")
    if getattr(config, "beta", 0.0) == 0.0:
        out["ref_log_probs"] = ("beta=0.0: TRL loads the reference model only with beta > 0 (set beta > 0; "
                                "the objective's own KL then replaces TRL's β·KL term)")
    steps, size = getattr(config, "steps_per_generation", 1) or 1, getattr(config, "num_generations", 1)
    per_device = getattr(config, "per_device_train_batch_size", 1)
    evaluating = getattr(config, "eval_strategy", "no") not in ("no", None)
    eval_size = getattr(config, "num_generations_eval", None) or size
    eval_per_device = getattr(config, "per_device_eval_batch_size", 1)
    if steps != 1:
        out["groups"] = (f"steps_per_generation={steps}: TRL shuffles the rows of a generation batch and slices "
                         "it into that many loss calls, splitting prompts' groups; set steps_per_generation=1")
    elif per_device % size:
        out["groups"] = (f"per_device_train_batch_size={per_device} is not a multiple of num_generations={size}: "
                         "a prompt's group would straddle processes; make it a multiple")
    elif evaluating and eval_per_device % eval_size:
        out["groups"] = (f"per_device_eval_batch_size={eval_per_device} is not a multiple of num_generations_eval"
                         f"={eval_size}: a prompt's group would straddle processes; make it a multiple")
    accumulation = getattr(config, "gradient_accumulation_steps", 1)
    if accumulation != 1 and steps % accumulation:
        # the no-grad passes before a step read its micro-batches, which must all be generated by then
        out["batch"] = (f"steps_per_generation={steps} is not a multiple of gradient_accumulation_steps="
                        f"{accumulation}: an optimizer step's micro-batches would come from two generation batches, "
                        "the later one not yet generated when the step's batch statistics are taken; make "
                        "steps_per_generation a multiple of gradient_accumulation_steps")
    return out
