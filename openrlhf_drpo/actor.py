"""The Ray actor drpo-train's launcher uses in place of OpenRLHF's PolicyModelActor.

Subclassing the Ray actor class itself raises, so this subclasses the class underneath
(`__ray_actor_class__`), lets OpenRLHF build its model and trainer, then installs the
compiled objective where ActorPPOTrainer calls its policy loss."""
from __future__ import annotations

import functools
import json

import ray
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from openrlhf_drpo import cpu_mode


def build_loss(spec):
    """The ObjectiveLoss for a spec shipped in the args (its text, not a path)."""
    from dsl import parse
    from openrlhf_drpo.loss import ObjectiveLoss
    spec = json.loads(spec) if isinstance(spec, str) else spec
    obj = parse(spec["source"], spec["path"]).with_overrides(spec["params"], spec["options"])
    return ObjectiveLoss(obj)


def install_objective(trainer, spec, step_log=None):
    """Replace the trainer's PolicyLoss by the compiled objective, and route the objective's
    per-step metrics into experience.info, where OpenRLHF picks up 0-d tensors for its logs
    (reduced over ranks like its own ppo_kl and clip_ratio). OpenRLHF averages every metric
    over a step's updates, so drpo_ratio_max is set to the step's true maximum afterwards.
    With `step_log` (a path), rank 0 appends one JSON line per optimizer step: what drpo-lab
    reads (the gradient norm before clipping, r's range, the largest per-token weight)."""
    loss_fn = build_loss(spec)
    loss_fn.track_extremes = bool(step_log)
    trainer.actor_loss_fn = loss_fn
    original_step, original_train = trainer.training_step, trainer.ppo_train
    step = {"index": 0, "update": 0, "ratio_max": []}

    @functools.wraps(original_step)
    def training_step(experience, *args, **kwargs):
        loss_fn.sink = experience.info
        try:
            status = original_step(experience, *args, **kwargs)
        finally:
            loss_fn.sink = None
        step["ratio_max"].append(float(loss_fn.metrics["drpo_ratio_max"]))
        if step_log and trainer.strategy.is_rank_0():
            keep = experience.action_mask.bool()
            grad_norm = status["metrics"].get("actor_grad_norm")
            row = {"step": step["index"] + 1, "update": step["update"], **loss_fn.extremes,
                   "grad_norm": None if grad_norm is None else float(grad_norm),
                   "dead": bool((experience.advantages[keep] == 0).all())}
            with open(step_log, "a") as f:
                f.write(json.dumps(row) + "\n")
        step["update"] += 1
        return status

    @functools.wraps(original_train)
    def ppo_train(*args, **kwargs):
        step["ratio_max"], step["update"] = [], 0
        status = original_train(*args, **kwargs)
        if step["ratio_max"]:
            status["drpo_ratio_max"] = trainer.strategy.all_reduce(max(step["ratio_max"]), op="max")
        step["index"] += 1
        return status
    trainer.training_step, trainer.ppo_train = training_step, ppo_train
    return loss_fn


class _DrpoPolicyModelActor(PolicyModelActor.__ray_actor_class__):
    def __init__(self, *args, **kwargs):
        if cpu_mode.active():
            cpu_mode.adapt_trainer_process()
        super().__init__(*args, **kwargs)

    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        out = super().init_model_from_pretrained(strategy, *args, **kwargs)
        self.drpo_loss = install_objective(self.trainer, strategy.args.drpo.spec,
                                           getattr(strategy.args.drpo, "step_log", None))
        strategy.print(f"openrlhf-drpo: policy loss is {self.drpo_loss!r}")
        return out

    def drpo_objective(self, spec=None) -> dict:
        """What this actor trains with (building it from `spec` if it has no model yet)."""
        loss = getattr(self, "drpo_loss", None) or build_loss(spec)
        obj = loss.objective
        return {"name": obj.name, "objective": obj.canonical().splitlines()[-1],
                "params": {k: float(v) for k, v in obj.params.items()}, "options": obj.options,
                "loss": type(loss).__name__, "fused": loss.fused}


DrpoPolicyModelActor = ray.remote(num_gpus=1)(_DrpoPolicyModelActor)
