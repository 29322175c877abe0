"""Staleness in OpenRLHF's asynchronous mode (--train.async_enable; issue 38, item 3).

OpenRLHF 0.11.2's PPOTrainerAsync runs a generator actor and a training actor over a queue of
rollout batches (--train.async_queue_size). Without --train.partial_rollout_enable one lock
(VLLMLock) is held over each generation (ppo_trainer_async.py:128-140) and over each weight
broadcast (:255-265), so every sample is drawn by one version of the weights. drpo-train keeps
the version in that lock: the training actor advances it inside the lock after each broadcast
that follows an actor training; the generator reads it inside the lock at each vLLM call (a
call's samples beyond one training batch wait in SamplesGenerator's buffer with their own tag);
the training actor turns each sample's tag into its staleness, its own count minus the tag,
before it makes the experiences. The loss reads it from experience.info (logged as
drpo_staleness). With --train.partial_rollout_enable a response mixes versions: refused.
"""
from __future__ import annotations

import ray
import torch
from openrlhf.trainer import ppo_trainer_async
from openrlhf.trainer.ppo_trainer import BasePPOTrainer

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


class _Lock(ppo_trainer_async.VLLMLock.__ray_actor_class__):
    """OpenRLHF's lock, holding the policy version of the weights the engines have."""

    def __init__(self):
        super().__init__()
        self._version = 0

    async def drpo_version(self) -> int:
        return self._version

    async def drpo_advance(self) -> int:
        self._version += 1
        return self._version


class _Generator(ppo_trainer_async.GenerateSamplesActor.__ray_actor_class__):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples_generator._generate_vllm = versioned(self.samples_generator._generate_vllm,
                                                          lambda: ray.get(self.vllm_lock.drpo_version.remote()))


def versioned(generate, read_version):
    """SamplesGenerator._generate_vllm whose experiences carry the version read before it runs
    (the caller holds the lock, so no broadcast comes between)."""
    def call(*args, **kwargs):
        version = read_version()
        experiences, *rest = generate(*args, **kwargs)
        return (tag_version(experiences, version), *rest)
    return call


class _Broadcast(BasePPOTrainer):
    """Between TrainingActor and BasePPOTrainer in the training actor's MRO: TrainingActor's
    broadcast_to_vllm takes the lock and calls this one, which advances the version before the
    lock is released (a generation waiting on it then reads the new one)."""

    def broadcast_to_vllm(self):
        super().broadcast_to_vllm()
        if self._drpo_trained:     # a step that trained the actor: new weights, a new version
            self._drpo_version = ray.get(self.vllm_lock.drpo_advance.remote())
            self._drpo_trained = False


class _Training(ppo_trainer_async.TrainingActor.__ray_actor_class__, _Broadcast):
    _drpo_version, _drpo_trained = 0, False

    def train_step(self, rollout_samples, global_step):
        tag_staleness(rollout_samples, self._drpo_version)
        return super().train_step(rollout_samples, global_step)

    def ppo_train(self, global_steps):
        # BasePPOTrainer.ppo_train trains the actor only past --critic.freezing_steps (ppo_trainer.py:272)
        self._drpo_trained = global_steps > self.args.critic.freezing_steps
        return super().ppo_train(global_steps)


def _remote(original, cls):
    return ray.remote(**original._default_options)(cls) if original._default_options else ray.remote(cls)


class _Trainer(ppo_trainer_async.PPOTrainerAsync.__ray_actor_class__):
    """PPOTrainerAsync building drpo-train's lock, generator and training actor (in its own process)."""

    def __init__(self, *args, **kwargs):
        m = ppo_trainer_async
        parts = {"VLLMLock": (m.VLLMLock, _Lock), "GenerateSamplesActor": (m.GenerateSamplesActor, _Generator),
                 "TrainingActor": (m.TrainingActor, _Training)}
        try:
            for name, (original, cls) in parts.items():
                setattr(m, name, _remote(original, cls))
            super().__init__(*args, **kwargs)
        finally:
            for name, (original, _) in parts.items():
                setattr(m, name, original)


VersionedTrainer = _remote(ppo_trainer_async.PPOTrainerAsync, _Trainer)
