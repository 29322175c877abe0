"""The verl adapter: importing this module registers every shipped objective in verl's
policy-loss registry as `dsl:<name>`, so that

    VERL_USE_EXTERNAL_MODULES=openrlhf_drpo.verl python3 -m verl.trainer.main_ppo \
        actor_rollout_ref.actor.policy_loss.loss_mode=dsl:drpo ...

trains with objectives/drpo.dsl. A user's own file, or a shipped one at other parameters, is
named in verl's config itself, `loss_mode="dsl:my.dsl?delta=0.3"` (registered when verl's
get_policy_loss_fn looks it up), or registered with `register("my.dsl", name="mine", delta=0.3)`
from a module that verl imports the same way (VERL_USE_EXTERNAL_MODULES=my_module). Each call
follows verl's policy-loss signature: verl's loss_agg_mode with its global batch info
(config.global_batch_info) and its rollout IS weights, and the metrics come back in verl's
metrics dict. π_ref, H (with its gradient) and the group ids (uid) come from verl's actor loss
(ppo_loss, which the adapter wraps unchanged), under the settings GIVEN names. Importing it checks
verl is the release it follows, extends verl's registry (the same dict), points verl's modules at
its get_policy_loss_fn and ppo_loss, and changes no environment variable or import hook."""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import torch

import dsl
from dsl.parser import Objective
from openrlhf_drpo.core import METRIC_KEYS, Aggregation, CompiledLoss
from openrlhf_drpo.core.kernels import compute_dtype
from openrlhf_drpo.core.loss import objective_inputs
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.workers.utils import losses as actor_losses
from verl.workers.utils.padding import no_padding_2_padding

if TYPE_CHECKING:      # (verl's own annotations' types)
    from omegaconf import DictConfig
    from tensordict import TensorDict
    from verl.workers.config import ActorConfig

PREFIX = "dsl:"
VERL_VERSION = "0.9.1"
# verl 0.9.1's policy-loss call (its actor passes these keywords; its own losses take them) and
# the global batch info its agg_loss reads from config.global_batch_info, which ours follow
_POLICY_LOSS_PARAMS = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
                       "rollout_is_weights"]
_PPO_LOSS_PARAMS = ["config", "model_output", "data", "dp_group"]     # verl's actor loss
_AGG_LOSS_PARAMS = ["loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens", "global_batch_size",
                    "loss_scale_factor"]


# What verl 0.9.1's actor never gives a policy loss (CompiledLoss.inputs() keys), with why in
# verl's terms. A micro-batch holds whole responses (ppo_loss pads each back to a row), so prefix
# reductions need nothing here; π_ref, H and the groups come from verl's actor loss (GIVEN).
NOT_GIVEN = {
    "rollout_log_probs": ("verl gives a policy loss none: verl's policy-loss call passes rollout IS weights, not "
                          "rollout log-probs; use an objective on μ with verl's algorithm.rollout_correction instead"),
    "sum_pi_sq": ("verl computes no Σ_v π_v² at the update: its trainer sets calculate_sum_pi_squared only for "
                  "the old policy's forward (ray_trainer._compute_old_log_prob, for OTB's advantage estimator), "
                  "never in _update_actor's batch, so the policy being trained has none"),
    "turns": "verl gives a policy loss response_mask alone, no turn ids (multi-turn rollouts fold tool turns into it)",
    "staleness": "verl gives a policy loss no policy versions (fully_async keeps min/max_global_steps off it)",
    "batch": ("verl calls a policy loss once per micro-batch (ppo_micro_batch_size_per_gpu), not once per "
              "optimizer step's batch"),
    "memory": ("verl calls a policy loss once per micro-batch, with no call after the optimizer step and no place "
               "in its checkpoint for a loss's state (its own adaptive KL controller is not saved either: verl #2653), "
               "so a controlled parameter or the step counter could be neither updated once per step nor resumed"),
    **dict.fromkeys(("vocab_log_probs", "vocab_ref_log_probs"), (
        "verl gives a policy loss the sampled token's log-probs only: its top-k KL is computed from the logits "
        "in its distillation loss's logits processor (distillation.distillation_loss.loss_mode forward_kl_topk or "
        "forward_kl_topk_tail, with the teacher's top-k from distillation), which no policy loss reaches")),
}
# What verl's actor loss (verl.workers.utils.losses.ppo_loss, once per micro-batch) holds that its
# policy-loss call drops, and the settings under which verl fills it: ppo_loss below hands it on.
GIVEN = {"ref_log_probs": "verl's ref_log_prob (actor_rollout_ref.actor.use_kl_loss=True, kl_loss_coef=0)",
         "entropy": "verl's entropy, with its gradient (actor_rollout_ref.actor.calculate_entropy=True, "
                    "entropy_coeff=0)",
         "groups": "verl's uid, each prompt's rollout.n responses whole in a micro-batch (trainer.use_v1=False, "
                   "trainer.balance_batch=False, actor_rollout_ref.actor.shuffle=False, use_dynamic_bsz=False, "
                   "ppo_micro_batch_size_per_gpu a multiple of rollout.n)"}


class VerlObjectiveLoss(CompiledLoss):
    provides = GIVEN     # and log π, μ, A and the mask; NOT_GIVEN says why not the others

    def lacks(self, config: ActorConfig | DictConfig | None) -> dict:
        return NOT_GIVEN


# verl 0.9.1's actor settings (actor_rollout_ref.actor.*) that only its own policy losses read
# (core_algos), which the objective replaces: setting → (verl's default, the objective's
# equivalent at the value set). verl hands a policy loss its config only at the call: a call
# whose config sets one is refused there, at the first step (verl's distillation config lacks some).
SUPERSEDED = {
    "clip_ratio": (0.2, "the objective's clip parameters, loss_mode=dsl:ppo?eps_low={0}&eps_high={0}"),
    "clip_ratio_low": (0.2, "the objective's lower clip, loss_mode=dsl:grpo_clip_higher?eps_low={0}"),
    "clip_ratio_high": (0.2, "the objective's upper clip, loss_mode=dsl:grpo_clip_higher?eps_high={0}"),
    "clip_ratio_c": (3.0, "dual clip's c, loss_mode=dsl:ppo_dual_clip?c={0} (or DPPO's truncation min(r, {0}) "
                          "written in the objective)"),
    "tau_pos": (1.0, "SAPO's temperature, loss_mode=dsl:sapo?tau_pos={0}"),
    "tau_neg": (1.05, "SAPO's temperature, loss_mode=dsl:sapo?tau_neg={0}"),
    "policy_loss.dro_beta": (None, "DRO's penalty, loss_mode=dsl:dro?tau={0}"),
    "policy_loss.clip_cov_ratio": (0.0002, "none: verl's clip_cov loss alone reads it"),
    "policy_loss.clip_cov_lb": (1.0, "none: verl's clip_cov loss alone reads it"),
    "policy_loss.clip_cov_ub": (5.0, "none: verl's clip_cov loss alone reads it"),
    "policy_loss.kl_cov_ratio": (0.0002, "none: verl's kl_cov loss alone reads it"),
    "policy_loss.ppo_kl_coef": (0.1, "none: verl's kl_cov loss alone reads it"),
}
_ABSENT = object()


def refuse_superseded(config: ActorConfig | DictConfig, name: str) -> None:
    """Refuses a verl config that sets a SUPERSEDED setting (at any value but verl's default)."""
    def value(path):
        node = config
        for key in path.split("."):
            node = getattr(node, key, _ABSENT)
        return node
    given = {path: v for path, (default, _) in SUPERSEDED.items() if (v := value(path)) is not _ABSENT and v != default}
    if given:
        raise ValueError("; ".join(f"actor_rollout_ref.actor.{path}={v}" for path, v in given.items()) +
                         f": verl's own policy losses read {'these' if len(given) > 1 else 'this'}, and the objective "
                         f"'{name}' replaces them, so {'they' if len(given) > 1 else 'it'} would have no effect: "
                         f"leave {', '.join(f'{p}={SUPERSEDED[p][0]}' for p in given)}. In the objective: " +
                         "; ".join(f"{p}: {SUPERSEDED[p][1].format(v)}" for p, v in given.items()))


def refuse_aggregate(objective: Objective, loss_agg_mode: str) -> None:
    """An objective that declares @aggregate is trained only under the loss_agg_mode of that name (verl's
    agg_loss has each of the language's four); one that declares none takes loss_agg_mode's (docs/hosts.md)."""
    declared = objective.options["aggregate"] if "aggregate" in objective.declared else None
    if declared is not None and declared != loss_agg_mode:
        raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}: verl aggregates the policy loss so, "
                         f"and objective '{objective.name}' declares @aggregate = {declared}, which verl's aggregation "
                         f"would replace: set actor_rollout_ref.actor.loss_agg_mode={declared}")


def _aggregation(mode, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl's agg_loss as (our mode, normalizer, per-response length): a token sum over a global
    count, exactly. verl's sequence means divide by `mask.sum(-1) + 1e-8` in the dtype torch
    promotes that to (float32 for verl's bool mask, where the 1e-8 vanishes), ours by count + 1e-8
    in the loss's dtype; so each token carries verl's own 1/length instead."""
    # with several data-parallel ranks a local count would be a silent misscale: refused, as agg_loss
    if dp_size > 1 and mode != "token-sum" and (batch_num_tokens if mode == "token-mean" else global_batch_size) is None:
        raise ValueError(f"{'(global) batch_num_tokens' if mode == 'token-mean' else 'global_batch_size'} "
                         "is required when dp_size > 1")
    if mode == "token-mean":
        return mode, None if batch_num_tokens is None else batch_num_tokens / dp_size, None
    if mode == "token-sum":
        return "token-mean", 1 / dp_size, None
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        raise ValueError(f"Invalid loss_agg_mode: {mode}")
    sequences = (mask.sum(-1) > 0).sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        return "token-mean", sequences / dp_size, mask.sum(dim=-1, keepdim=True) + 1e-8
    horizon = (loss_scale_factor or mask.shape[-1]) if mode == "seq-mean-token-sum-norm" else 1
    return "token-mean", sequences * horizon / dp_size, None


# verl's actor loss for the micro-batch being computed: (model output, micro-batch), set by ppo_loss
_MICRO_BATCH = contextvars.ContextVar("openrlhf_drpo_verl_micro_batch", default=None)


def ppo_loss(config: ActorConfig, model_output: dict, data: TensorDict,
             dp_group: torch.distributed.ProcessGroup | None = None) -> tuple[torch.Tensor, dict]:
    """verl's actor loss (verl.workers.utils.losses.ppo_loss, which its actor worker binds with its
    config and its engine calls once per micro-batch), unchanged, with the model output and the
    micro-batch kept for the policy loss it calls: they hold what the policy-loss call drops."""
    token = _MICRO_BATCH.set((model_output, data))
    try:
        return _verl_ppo_loss(config, model_output, data, dp_group)
    finally:
        _MICRO_BATCH.reset(token)


def _superseded(name, setting, value, why):
    raise ValueError(f"actor_rollout_ref.actor.{setting}={value}: verl adds its own {why} to the loss, and the "
                     f"objective '{name}' has its own: leave {setting}=0 (the objective's term replaces verl's)")


def actor_inputs(core: CompiledLoss, config: ActorConfig | DictConfig | None, log_prob: torch.Tensor) -> dict:
    """The inputs in GIVEN the objective reads, from verl's micro-batch as verl's ppo_loss reads its
    own (padded to log_prob's rows); refused by name where verl's settings withhold one, or set a
    term of verl's own that the objective's replaces."""
    reads, name = core.inputs().keys() & GIVEN.keys(), core.objective.name
    if not reads:
        return {}
    call = _MICRO_BATCH.get()
    if call is None or config is None:
        core.refuse_missing({k: "this policy-loss call did not come through verl's actor loss "
                                "(verl.workers.utils.losses.ppo_loss), which alone holds it" for k in reads})
    model_output, data = call
    out, missing = {}, {}
    if "entropy" in reads:
        if config.entropy_coeff != 0:
            _superseded(name, "entropy_coeff", config.entropy_coeff, "entropy bonus (entropy_coeff·H)")
        if model_output.get("entropy") is None:
            missing["entropy"] = ("verl's actor computed no entropy at the update: it does only with "
                                  "actor_rollout_ref.actor.calculate_entropy=True or entropy_coeff != 0 "
                                  "(ray_trainer._update_actor); set calculate_entropy=True")
        else:
            out["entropy"] = no_padding_2_padding(model_output["entropy"], data).to(log_prob.dtype)
    if "ref_log_probs" in reads:
        if config.use_kl_loss and config.kl_loss_coef != 0:
            _superseded(name, "kl_loss_coef", config.kl_loss_coef, f"KL to the reference ({config.kl_loss_type})")
        if not config.use_kl_loss and "ref_log_prob" in data.keys():
            # verl makes a reference only for use_kl_loss or use_kl_in_reward (need_reference_policy):
            # here, for the latter, whose KL penalty in the rewards the objective's own would repeat
            raise ValueError(f"algorithm.use_kl_in_reward=True: verl adds its own KL penalty to the rewards "
                             f"(ray_trainer.apply_kl_penalty), and the objective '{name}' has its own KL to "
                             "π_ref: set algorithm.use_kl_in_reward=False and actor_rollout_ref.actor.use_kl_loss=True "
                             "with kl_loss_coef=0 (the objective's term replaces verl's)")
        if "ref_log_prob" not in data.keys():
            missing["ref_log_probs"] = ("verl's batch has no ref_log_prob: verl computes it only with "
                                        "actor_rollout_ref.actor.use_kl_loss=True or algorithm.use_kl_in_reward=True "
                                        "(trainer/ppo/utils.py need_reference_policy); set use_kl_loss=True with "
                                        "kl_loss_coef=0")
        else:
            out["ref_log_probs"] = data.select("ref_log_prob").to_padded_tensor()["ref_log_prob"].to(log_prob)
    if "groups" in reads:
        out["groups"] = _groups(config, data, log_prob, missing)
    core.refuse_missing(missing)
    return out


def _groups(config, data, log_prob, missing):
    """verl's uid as group ids, once each prompt's rollout.n responses are whole in the micro-batch:
    verl's actor sets no force_group_size (ray_trainer._update_actor), so only its settings keep them."""
    n = config.rollout_n
    split = [f"{k}={v}" for k, v, bad in [("shuffle", config.shuffle, config.shuffle),
                                         ("use_dynamic_bsz", config.use_dynamic_bsz, config.use_dynamic_bsz),
                                         ("ppo_micro_batch_size_per_gpu", config.ppo_micro_batch_size_per_gpu,
                                          (config.ppo_micro_batch_size_per_gpu or 1) % n)] if bad]
    uids = list(data["uid"]) if "uid" in data.keys() else None
    if uids is not None and not split:
        counts = {u: uids.count(u) for u in uids}
        split = [f"uid {u!r} has {c} of its {n} responses in this micro-batch" for u, c in counts.items() if c != n][:1]
    if uids is None or split:
        missing["groups"] = ("verl's micro-batch " + ("carries no uid" if uids is None else
                             f"need not hold a prompt's responses whole ({'; '.join(split)})") +
                             ": verl keeps them whole with trainer.use_v1=False and trainer.balance_batch=False "
                             "(its v1 trainer balances every batch: trainer_base._balance_batch), actor_rollout_ref."
                             "actor.shuffle=False, use_dynamic_bsz=False and ppo_micro_batch_size_per_gpu a multiple "
                             f"of rollout.n={n} (its actor sets no force_group_size: ray_trainer._update_actor)")
        return None
    ids = {u: i for i, u in enumerate(dict.fromkeys(uids))}
    return torch.tensor([ids[u] for u in uids], device=log_prob.device)


def policy_loss(core: CompiledLoss, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                config: ActorConfig | DictConfig | None = None,
                rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's PolicyLossFn: (loss, metrics). μ is verl's old log-probs."""
    if config is not None:
        refuse_superseded(config, core.objective.name)
    info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    mode, norm, factor = _aggregation(loss_agg_mode, response_mask, **info)
    weights = rollout_is_weights
    if factor is not None:       # verl's x / length, in the loss's precision
        factor = 1 / factor.to(compute_dtype(log_prob))
        weights = factor.expand_as(log_prob) if weights is None else weights * factor
    inputs = actor_inputs(core, config, log_prob)
    refuse_aggregate(core.objective, loss_agg_mode)
    loss, metrics = core(log_prob, old_log_prob, advantages, response_mask,
                         aggregation=Aggregation(mode, norm=norm, weights=weights), **inputs)
    values = metrics.values.tolist()      # one host sync for all of them
    out = {f"actor/{m.key}": x for m, x in zip(metrics.fields, values) if m.key}
    out["actor/ppo_kl"] = values[[m.name for m in metrics.fields].index("neg_log_ratio_mean")]
    return loss, out


def register(objective: str | Objective, name: str | None = None, **params) -> str:
    """Registers `objective` (a shipped name, a path or a dsl.Objective) at `params` in verl's
    policy-loss registry as dsl:<name> (the objective's own name by default) and returns that
    loss_mode. The objective is parsed and compiled here: a bad file stops with its located error.
    The aggregation is verl's loss_agg_mode, which must be the objective's @aggregate where it declares
    one (refused at the first call otherwise: refuse_aggregate), and an
    objective that reads what verl's actor never gives (NOT_GIVEN: rollout log-probs, Σ_v π_v²,
    the whole batch) is refused here, not at the first step; π_ref, H and groups at the first
    step where verl's settings withhold them (actor_inputs)."""
    if "aggregate" in params:
        raise ValueError("the aggregation is verl's actor_rollout_ref.actor.loss_agg_mode, not an objective parameter")
    core = VerlObjectiveLoss(objective, **params)      # refuses what NOT_GIVEN lists
    mode = PREFIX + (name or core.objective.name)
    register_policy_loss(mode)(functools.partial(policy_loss, core))
    return mode


def _check_verl():
    """verl is the release this adapter follows (its policy-loss call, its aggregation's global
    batch info, how get_policy_loss_fn looks a loss up), and the first two are as policy_loss
    takes them; anything else fails here, clearly, before anything is registered."""
    try:
        installed = version("verl")
    except PackageNotFoundError:
        installed = "(of unknown version: no package metadata)"
    if installed != VERL_VERSION:
        raise RuntimeError(f"openrlhf_drpo.verl: verl {installed} is installed; the adapter is built against "
                           f"verl=={VERL_VERSION} (its policy-loss call, global batch info and loss lookup change "
                           f"between releases): pip install verl=={VERL_VERSION}")
    for what, fn, expected in [("policy loss (vanilla)", core_algos.POLICY_LOSS_REGISTRY.get("vanilla"),
                                _POLICY_LOSS_PARAMS), ("agg_loss", core_algos.agg_loss, _AGG_LOSS_PARAMS),
                               ("actor loss (ppo_loss)", actor_losses.ppo_loss, _PPO_LOSS_PARAMS)]:
        params = None if fn is None else list(inspect.signature(fn).parameters)
        if params != expected:
            raise RuntimeError(f"openrlhf_drpo.verl: verl's {what} takes {params}, expected {expected} "
                               f"(verl {VERL_VERSION}'s, which policy_loss follows)")


def get_policy_loss_fn(name: str) -> core_algos.PolicyLossFn:
    """verl's get_policy_loss_fn, which first registers the loss_mode asked for, and only it,
    where it carries its objective and parameters, `dsl:<name or path>?delta=0.2&eps_high=0.28`:
    verl's PolicyLossConfig takes no keys of ours, so its config sets them through loss_mode."""
    if isinstance(name, str) and name.startswith(PREFIX) and name not in core_algos.POLICY_LOSS_REGISTRY:
        objective, _, query = name[len(PREFIX):].partition("?")
        pairs = [kv.partition("=") for kv in query.split("&") if kv]
        if not objective or any(not k or not sep for k, sep, _ in pairs):
            raise ValueError(f"loss_mode {name!r}: write dsl:<name or path>?<param>=<value>&<param>=<value>")
        try:
            register(objective, name=name[len(PREFIX):], **{k: v for k, _, v in pairs})
        except dsl.DslError as e:        # say which loss_mode, then the located error
            raise ValueError(f"loss_mode {name!r}:\n{e.render()}") from None
    return _verl_get_policy_loss_fn(name)


_check_verl()
# verl's callers import get_policy_loss_fn and ppo_loss by name (verl.workers.utils.losses, its
# engine_workers, verl.trainer.distillation.losses): one imported after this takes ours from the
# module that defines it, one imported before is pointed at it. verl's registry stays its own dict.
_verl_get_policy_loss_fn, _verl_ppo_loss = core_algos.get_policy_loss_fn, actor_losses.ppo_loss
for _module in [core_algos, actor_losses, *(m for n, m in list(sys.modules.items()) if n.startswith("verl."))]:
    for _name, _verls, _ours in [("get_policy_loss_fn", _verl_get_policy_loss_fn, get_policy_loss_fn),
                                 ("ppo_loss", _verl_ppo_loss, ppo_loss)]:
        if getattr(_module, _name, None) is _verls:
            setattr(_module, _name, _ours)
# the shipped objectives verl's actor can feed (the others would be refused, saying why)
SHIPPED = [register(n) for n in dsl.shipped_names()
           if not objective_inputs(dsl.load(n)).keys() & NOT_GIVEN.keys()]
__all__ = ["GIVEN", "METRIC_KEYS", "NOT_GIVEN", "PREFIX", "SHIPPED", "SUPERSEDED", "VERL_VERSION", "VerlObjectiveLoss",
           "actor_inputs", "get_policy_loss_fn", "policy_loss", "ppo_loss", "refuse_aggregate", "refuse_superseded",
           "register"]
