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
metrics dict. Importing it checks verl is the release it follows, extends verl's registry (the
same dict) and changes no environment variable or import hook."""
from __future__ import annotations

import functools
import inspect
import sys
from importlib.metadata import PackageNotFoundError, version

import dsl
from dsl.parser import Objective
from openrlhf_drpo.core import METRIC_KEYS, Aggregation, CompiledLoss
from openrlhf_drpo.core.kernels import compute_dtype
from openrlhf_drpo.core.loss import objective_inputs
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import register_policy_loss

PREFIX = "dsl:"
VERL_VERSION = "0.9.1"
# verl 0.9.1's policy-loss call (its actor passes these keywords; its own losses take them) and
# the global batch info its agg_loss reads from config.global_batch_info, which ours follow
_POLICY_LOSS_PARAMS = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
                       "rollout_is_weights"]
_AGG_LOSS_PARAMS = ["loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens", "global_batch_size",
                    "loss_scale_factor"]


# What verl 0.9.1's policy-loss call (_POLICY_LOSS_PARAMS) never carries, against each input an
# objective may read (CompiledLoss.inputs()), with what verl has instead. A micro-batch holds
# whole responses (ppo_loss pads each back to a row), so prefix reductions need nothing here.
NOT_GIVEN = {
    "rollout_log_probs": ("verl gives a policy loss none: verl's policy-loss call passes rollout IS weights, not "
                          "rollout log-probs; use an objective on μ with verl's algorithm.rollout_correction instead"),
    "ref_log_probs": ("verl gives a policy loss no reference log-probs; verl's own KL to the reference is "
                      "actor_rollout_ref.actor.use_kl_loss with kl_loss_type and kl_loss_coef"),
    "entropy": ("verl gives a policy loss no entropy; verl's own entropy bonus is "
                "actor_rollout_ref.actor.entropy_coeff"),
    "sum_pi_sq": "verl gives a policy loss no Σ_v π_v² (it computes one only for OTB's advantage estimator)",
    "groups": ("verl gives a policy loss no group ids (uid), and its micro-batches need not hold a prompt's "
               "responses together (trainer.balance_batch, use_dynamic_bsz and shuffle reorder them)"),
    "batch": ("verl calls a policy loss once per micro-batch (ppo_micro_batch_size_per_gpu), not once per "
              "optimizer step's batch"),
    **dict.fromkeys(("vocab_log_probs", "vocab_ref_log_probs"), (
        "verl gives a policy loss the sampled token's log-probs only: its top-k KL is computed from the logits "
        "in its distillation loss's logits processor (distillation.distillation_loss.loss_mode forward_kl_topk or "
        "forward_kl_topk_tail, with the teacher's top-k from distillation), which no policy loss reaches")),
}


class VerlObjectiveLoss(CompiledLoss):
    provides: dict = {}     # none of the inputs beyond log π, μ, A and the mask: NOT_GIVEN says why

    def lacks(self, config) -> dict:
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


def refuse_superseded(config, name: str) -> None:
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


def policy_loss(core: CompiledLoss, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None):
    """verl's PolicyLossFn: (loss, metrics). μ is verl's old log-probs."""
    if config is not None:
        refuse_superseded(config, core.objective.name)
    info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    mode, norm, factor = _aggregation(loss_agg_mode, response_mask, **info)
    weights = rollout_is_weights
    if factor is not None:       # verl's x / length, in the loss's precision
        factor = 1 / factor.to(compute_dtype(log_prob))
        weights = factor.expand_as(log_prob) if weights is None else weights * factor
    loss, metrics = core(log_prob, old_log_prob, advantages, response_mask,
                         aggregation=Aggregation(mode, norm=norm, weights=weights))
    values = metrics.values.tolist()      # one host sync for all of them
    out = {f"actor/{m.key}": x for m, x in zip(metrics.fields, values) if m.key}
    out["actor/ppo_kl"] = values[[m.name for m in metrics.fields].index("neg_log_ratio_mean")]
    return loss, out


def register(objective: str | Objective, name: str | None = None, **params) -> str:
    """Registers `objective` (a shipped name, a path or a dsl.Objective) at `params` in verl's
    policy-loss registry as dsl:<name> (the objective's own name by default) and returns that
    loss_mode. The objective is parsed and compiled here: a bad file stops with its located error.
    The aggregation is verl's loss_agg_mode (the objective's @aggregate is not used), and an
    objective that reads what verl hands a policy loss not (NOT_GIVEN: rollout log-probs, π_ref,
    H, Σ_v π_v², groups, the whole batch) is refused here, not at the first step."""
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
                                _POLICY_LOSS_PARAMS), ("agg_loss", core_algos.agg_loss, _AGG_LOSS_PARAMS)]:
        params = None if fn is None else list(inspect.signature(fn).parameters)
        if params != expected:
            raise RuntimeError(f"openrlhf_drpo.verl: verl's {what} takes {params}, expected {expected} "
                               f"(verl {VERL_VERSION}'s, which policy_loss follows)")


def get_policy_loss_fn(name):
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
# verl's callers import get_policy_loss_fn by name (verl.workers.utils.losses, verl.trainer.
# distillation.losses): one imported after this takes ours from core_algos, one imported before
# is pointed at it. verl's registry stays verl's own dict, only extended.
_verl_get_policy_loss_fn = core_algos.get_policy_loss_fn
for _module in [core_algos, *(m for n, m in list(sys.modules.items()) if n.startswith("verl."))]:
    if getattr(_module, "get_policy_loss_fn", None) is _verl_get_policy_loss_fn:
        _module.get_policy_loss_fn = get_policy_loss_fn
# the shipped objectives verl's policy-loss call can feed (the others would be refused, saying why)
SHIPPED = [register(n) for n in dsl.shipped_names()
           if not objective_inputs(dsl.load(n)).keys() & NOT_GIVEN.keys()]
__all__ = ["METRIC_KEYS", "NOT_GIVEN", "PREFIX", "SHIPPED", "SUPERSEDED", "VERL_VERSION", "VerlObjectiveLoss",
           "get_policy_loss_fn", "policy_loss", "refuse_superseded", "register"]
