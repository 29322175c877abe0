"""ObjectiveLoss: the OpenRLHF adapter over the loss core (openrlhf_drpo.core). OpenRLHF's actor
calls it exactly where it calls openrlhf.models.loss.PolicyLoss (same arguments, same 5-tuple)."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys

import torch

from dsl.parser import Objective
from openrlhf_drpo.core import METRIC_KEYS, Aggregation, CompiledLoss  # noqa: F401  (METRIC_KEYS: the names it logs)
from openrlhf_drpo.hosts.openrlhf.inputs import missing_at_launch

OPENRLHF_VERSION = "0.11.2"
_FORWARD_PARAMS = ["self", "log_probs", "old_log_probs", "advantages", "action_mask", "rollout_log_probs",
                   "dp_size", "batch_num_tokens", "global_batch_size"]


@contextlib.contextmanager
def _importing_openrlhf():
    """What importing openrlhf.models needs outside drpo-train, for that import only: the
    flash_attn shim (it imports flash_attn at module level) and, without CUDA, DS_ACCELERATOR=cpu
    (DeepSpeed, which it imports, else prints on stdout that it fell back to the CPU). Afterwards
    os.environ (also what DeepSpeed's import set in it), sys.meta_path and sys.modules are as they
    were: building a loss changes nothing process-wide (the stubs OpenRLHF bound stay bound)."""
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import FlashAttnShim
    environ = dict(os.environ)
    shim = None     # drpo-train's processes have theirs already; a real flash_attn needs none
    if not any(isinstance(f, FlashAttnShim) for f in sys.meta_path) and not importlib.util.find_spec("flash_attn"):
        shim = FlashAttnShim()
        sys.meta_path.append(shim)
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if shim is not None:
            sys.meta_path.remove(shim)
            for name, module in list(sys.modules.items()):
                if getattr(module, "__spec__", None) is not None and module.__spec__.loader is shim:
                    del sys.modules[name]
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})


@functools.lru_cache(maxsize=None)
def openrlhf_loss_module():
    """openrlhf.models.loss, after checking it is the pinned version with the 5-value
    PolicyLoss.forward this module imitates; anything else fails here, clearly."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        installed = version("openrlhf")
    except PackageNotFoundError:
        raise RuntimeError(f"openrlhf is not installed; openrlhf-drpo needs openrlhf=={OPENRLHF_VERSION} "
                           "(bash scripts/setup.sh installs it)") from None
    if installed != OPENRLHF_VERSION:
        raise RuntimeError(f"openrlhf {installed} is installed; openrlhf-drpo is built against "
                           f"openrlhf=={OPENRLHF_VERSION} (PolicyLoss's call and return arity changed between releases)")
    with _importing_openrlhf():
        from openrlhf.models import loss as L
    params = list(inspect.signature(L.PolicyLoss.forward).parameters)
    if params != _FORWARD_PARAMS:
        raise RuntimeError(f"openrlhf PolicyLoss.forward takes {params}, expected {_FORWARD_PARAMS}")
    x = torch.zeros(1, 2)
    n_out = len(L.PolicyLoss()(x, x, x, action_mask=torch.ones(1, 2)))
    if n_out != 5:
        raise RuntimeError(f"openrlhf PolicyLoss.forward returns {n_out} values, expected 5")
    return L


# topk_sum: the policy's own top-k, refused under any command line (ref_topk_sum is given: inputs.py)
POLICY_TOPK = dict.fromkeys(("vocab_log_probs", "vocab_ref_log_probs"), (
    "drpo-train gives π_ref's top-k only (ref_topk_sum): topk_sum sums over the current policy's top-k, whose "
    "π_ref log-probs would have to be scored at ids the policy chooses at train time, while OpenRLHF's reference "
    "model scores each response once, before the step (make_experience); write the sum over π_ref's top-k "
    "(ref_topk_sum), or train it where π_ref is scored beside the policy"))


class ObjectiveLoss(CompiledLoss):
    """A policy loss compiled from an objective file, called as OpenRLHF's PolicyLoss.

        loss_fn = ObjectiveLoss("drpo", delta=0.2)   # shipped name, path or dsl.Objective
        loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = loss_fn(
            log_probs, old_log_probs, advantages, action_mask=mask, rollout_log_probs=None,
            dp_size=1, batch_num_tokens=None, global_batch_size=None)

    Keyword overrides name parameters (ASCII or Unicode) or the options `anchor` and
    `aggregate`. `fused=False` runs the plain autograd path (the reference for the fused
    one); both aggregate as OpenRLHF's aggregate_loss does (tests/test_loss.py holds them to it);
    `compile` chooses torch.compile for the fused kernel ("auto": on CUDA inputs). After each
    call, `self.metrics` is its LossMetrics.
    """

    # drpo-train gives them under the flags missing_at_launch checks: rollout log-probs as PolicyLoss's
    # argument, the others through self.given (inputs.supplied), which a direct call has not
    provides = {"rollout_log_probs": "drpo-train keeps vLLM's log-probs for it",
                **{key: "drpo-train gives it in ObjectiveLoss.given, PolicyLoss's arguments have no place for it"
                   for key in ("ref_log_probs", "entropy", "sum_pi_sq", "groups", "turns", "staleness")},
                "vocab_log_probs": "drpo-train scores them on π_ref's top-k from the training forward's hidden states",
                "vocab_ref_log_probs": "drpo-train's reference model scores its top-k (--drpo.vocab_topk)",
                "batch": "drpo-train sums the optimizer step's micro-batches over the ranks, in no-grad passes "
                         "before the step where it has several",
                "memory": "drpo-train's policy actor calls end_step() after each DeepSpeed optimizer step over the "
                          "data-parallel ranks, logs it, saves it in the actor checkpoint and restores it (controls.py)"}
    argument_names = {"mask": "action_mask"}

    def lacks(self, config: object) -> dict:
        """What a drpo-train command line (OpenRLHF's flat args) withholds; nothing without one."""
        return {**({} if config is None else missing_at_launch(config)),
                **(POLICY_TOPK if self.support == "policy" else {})}

    def __init__(self, objective: str | Objective = "drpo", *, fused: bool = True, compile: bool | str = "auto",
                 **overrides: float):
        super().__init__(objective, fused=fused, compile=compile, **overrides)
        openrlhf_loss_module()      # the pinned OpenRLHF, checked
        self.sink: dict | None = None      # drpo-train points this at experience.info
        # drpo-train's inputs for the call beyond PolicyLoss's arguments (ref_log_probs, entropy,
        # sum_pi_sq, groups; process_group for batch reductions): inputs.supplied sets them per step
        self.given: dict = {}
        self.statistics = None      # drpo-train's BatchStatistics for the step it trains (inputs.step_statistics)

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor | None = None, rollout_log_probs: torch.Tensor | None = None,
                dp_size: int = 1, batch_num_tokens: int | torch.Tensor | None = None,
                global_batch_size: int | torch.Tensor | None = None) -> tuple:
        """PolicyLoss.forward's arguments and its five results: (loss, clip_ratio, ppo_kl, vllm_kl,
        is_filter_ratio), the last two None without rollout log-probs."""
        if action_mask is None:
            action_mask = torch.ones_like(log_probs, dtype=torch.bool)
        # OpenRLHF's aggregate_loss: the local count, or the global one over the ranks
        total = batch_num_tokens if self.aggregate == "token-mean" else global_batch_size
        given = dict(self.given)
        aggregation = Aggregation(norm=None if total is None else total / dp_size,
                                  process_group=given.pop("process_group", None))
        loss, metrics = super().forward(log_probs, old_log_probs, advantages, action_mask,
                                        rollout_log_probs=rollout_log_probs, aggregation=aggregation, **given)
        with torch.no_grad():
            clip_ratio = metrics.past_boundary_diverging
            # OpenRLHF's masked means, on selected values so NaN/inf in masked slots stay out
            masked_mean = lambda x: torch.where(action_mask.bool(), x, 0.0).sum() / metrics.tokens.clamp(min=1)  # noqa: E731
            if self.anchor == "old":
                ppo_kl = metrics.neg_log_ratio_mean       # masked_mean(-(log π - old log π))
            else:
                ppo_kl = masked_mean(old_log_probs - log_probs.detach())
            vllm_kl = is_filter_ratio = None
            if rollout_log_probs is not None:
                # as OpenRLHF reports it; the objective itself defines any off-policy correction
                vllm_kl = masked_mean(rollout_log_probs - old_log_probs)
                is_filter_ratio = torch.zeros((), device=log_probs.device)
            logged = metrics.logged()
            if "drpo_filtered" in logged:
                is_filter_ratio = logged["drpo_filtered"]
            if self.sink is not None:
                self.sink.update(logged)
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio
