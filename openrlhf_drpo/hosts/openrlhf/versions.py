"""Staleness in OpenRLHF's asynchronous mode (--train.async_enable; issue 38, item 3).

OpenRLHF 0.11.2's PPOTrainerAsync runs a generator actor and a training actor over a queue of
rollout batches (--train.async_queue_size). Without --train.partial_rollout_enable one lock
(VLLMLock) is held over each generation (ppo_trainer_async.py:128-140) and over each weight
broadcast (:255-265), so every sample is drawn by one version of the weights. drpo-train keeps
the version in a counter actor used only under that lock: the training actor advances it inside
the lock after each broadcast that follows an actor training; the generator reads it inside the
lock at each vLLM call (a
call's samples beyond one training batch wait in SamplesGenerator's buffer with their own tag);
the training actor turns each sample's tag into its staleness, its own count minus the tag,
before it makes the experiences. The loss reads it from experience.info (logged as
drpo_staleness). With --train.partial_rollout_enable a response mixes versions: refused.
"""
from __future__ import annotations

import ray
import torch
from openrlhf.trainer import ppo_trainer_async

from openrlhf_drpo.hosts.openrlhf.inputs import STALENESS_KEY

VERSION_KEY = "drpo_version"        # a sample's info: the version that sampled it (generator → trainer)


def tag_version(experiences, version: int):
    """Each experience's samples were drawn by the weights of `version`."""
    for e in experiences:
        e.info[VERSION_KEY] = torch.full((len(e.sequences),), version, dtype=torch.long)
    return experiences


def tag_staleness(samples, current: int) -> None:
    """At the trainer, version `current` about to train on `samples`: each one's staleness."""
    for s in samples:
        version = s.info.pop(VERSION_KEY, None)
        if version is None:
            raise RuntimeError("openrlhf-drpo: a rollout sample reached the asynchronous trainer without the policy "
                               "version that sampled it: its generator is not drpo-train's (versions.VersionedTrainer)")
        s.info[STALENESS_KEY] = (current - version).float()


class _Versions:
    """The policy version of the weights the engines hold: written and read only under OpenRLHF's
    lock. Its own Ray actor, not a subclass of OpenRLHF's (a subclass of a Ray actor's class breaks
    the zero-argument super() in the class's own methods in Ray's workers)."""

    def __init__(self):
        self.version = 0

    def get(self) -> int:
        return self.version

    def advance(self) -> int:
        self.version += 1
        return self.version


def versioned(generate, read_version):
    """SamplesGenerator._generate_vllm whose experiences carry the version read before it runs
    (the caller holds the lock, so no broadcast comes between)."""
    def call(*args, **kwargs):
        version = read_version()
        experiences, *rest = generate(*args, **kwargs)
        return (tag_version(experiences, version), *rest)
    return call


def install_generator(actor, versions) -> None:
    """On OpenRLHF's GenerateSamplesActor (run in its process): each vLLM call's samples tagged."""
    actor.samples_generator._generate_vllm = versioned(actor.samples_generator._generate_vllm,
                                                       lambda: ray.get(versions.get.remote()))


class _Broadcasts:
    """The training actor's actor_model_group, but for its weight broadcast, which TrainingActor
    runs under the lock (BasePPOTrainer.broadcast_to_vllm, ppo_trainer.py:316): after a step that
    trained the actor, the version advances before the lock is released."""

    def __init__(self, group, trainer, versions):
        self._group, self._trainer, self._versions = group, trainer, versions

    def __getattr__(self, name):
        return getattr(self._group, name)

    def async_run_method(self, method_name, *args, **kwargs):
        refs = self._group.async_run_method(method_name, *args, **kwargs)
        if method_name == "broadcast_to_vllm" and self._trainer.drpo_trained:
            ray.get(refs)
            self._trainer.drpo_version = ray.get(self._versions.advance.remote())
            self._trainer.drpo_trained = False
        return refs


def install_training(actor, versions) -> None:
    """On OpenRLHF's TrainingActor (run in its process): each batch's staleness set before its
    experiences are made; the version advanced by each broadcast after an actor training."""
    actor.drpo_version, actor.drpo_trained = 0, False
    actor.actor_model_group = _Broadcasts(actor.actor_model_group, actor, versions)
    train_step, ppo_train = actor.train_step, actor.ppo_train

    def step(rollout_samples, global_step):
        tag_staleness(rollout_samples, actor.drpo_version)
        return train_step(rollout_samples, global_step)

    def train(global_steps):
        # BasePPOTrainer.ppo_train trains the actor only past --critic.freezing_steps (ppo_trainer.py:272)
        actor.drpo_trained = global_steps > actor.args.critic.freezing_steps
        return ppo_train(global_steps)
    actor.train_step, actor.ppo_train = step, train


def _install(actor, install, versions):     # run by __ray_call__ (fn(actor, ...)) in the actor's process
    install(actor, versions)


class _Trainer(ppo_trainer_async.PPOTrainerAsync.__ray_actor_class__):
    """OpenRLHF's PPOTrainerAsync whose generator and training actors then count versions."""

    def __init__(self, *args, **kwargs):
        # (explicitly: Ray's copy of a subclassed actor class breaks zero-argument super())
        ppo_trainer_async.PPOTrainerAsync.__ray_actor_class__.__init__(self, *args, **kwargs)
        versions = ray.remote(num_cpus=0)(_Versions).remote()
        ray.get([self.generator_actor.__ray_call__.remote(_install, install_generator, versions),
                 self.trainer_actor.__ray_call__.remote(_install, install_training, versions)])


VersionedTrainer = ray.remote(_Trainer)
