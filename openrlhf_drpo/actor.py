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


def install_objective(trainer, spec):
    """Replace the trainer's PolicyLoss by the compiled objective, and route the objective's
    per-step metrics into experience.info, where OpenRLHF picks up 0-d tensors for its logs
    (reduced over ranks like its own ppo_kl and clip_ratio)."""
    loss_fn = build_loss(spec)
    trainer.actor_loss_fn = loss_fn
    original = trainer.training_step

    @functools.wraps(original)
    def training_step(experience, *args, **kwargs):
        loss_fn.sink = experience.info
        try:
            return original(experience, *args, **kwargs)
        finally:
            loss_fn.sink = None
    trainer.training_step = training_step
    return loss_fn


class _DrpoPolicyModelActor(PolicyModelActor.__ray_actor_class__):
    def __init__(self, *args, **kwargs):
        if cpu_mode.active():
            cpu_mode.adapt_trainer_process()
        super().__init__(*args, **kwargs)

    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        out = super().init_model_from_pretrained(strategy, *args, **kwargs)
        self.drpo_loss = install_objective(self.trainer, strategy.args.drpo.spec)
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
