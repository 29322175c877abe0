"""Staleness in OpenRLHF's asynchronous mode (issue 38, item 3): drpo-train's generator and training
actors (versions.py) run OpenRLHF 0.11.2's own async loops (GenerateSamplesActor.fit,
TrainingActor.fit, BasePPOTrainer.train_step / ppo_train / broadcast_to_vllm) in two threads of
this process. Fakes stand in only for Ray and vLLM: ray.get, an actor handle over the real lock
class, a thread queue for Ray's, the vLLM call (which stamps each sample with the engine's true
weights), and the model-actor group (append, fit, broadcast) and the experience maker's forwards."""
import asyncio
import queue
import threading
import types

import pytest
import ray
import torch

from openrlhf_drpo.hosts.openrlhf import cpu_mode

cpu_mode.install_flash_attn_shim()
from openrlhf.trainer import ppo_trainer_async  # noqa: E402
from openrlhf.trainer.ppo_utils import samples_generator  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import (Experience, make_experience_batch,  # noqa: E402
                                                   split_experience_batch)

from openrlhf_drpo.hosts.openrlhf import inputs, versions  # noqa: E402


class Handle:
    """A Ray actor handle over a local object: method.remote(...) runs it (coroutines on one loop)."""

    def __init__(self, obj):
        self.obj, self.loop = obj, asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def __getattr__(self, name):
        method = getattr(self.obj, name)
        if not asyncio.iscoroutinefunction(method):
            return types.SimpleNamespace(remote=method)
        return types.SimpleNamespace(remote=lambda *a, **k: asyncio.run_coroutine_threadsafe(
            method(*a, **k), self.loop).result())


class Pipeline:
    """vLLM's engine and the policy actors: the truth the tags are checked against."""

    def __init__(self):
        self.weights = 0            # the number of trainings whose weights the engine holds
        self.fits = 0               # the number of trainings done
        self.pending = []
        self.seen = []              # (staleness drpo-train gave, the true one) per sample

    def vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kwargs):
        prompts = [p for _, p in zip(range(num_prompts), dataloader_iter)]
        out = [Experience(sequences=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4),
                          action_mask=torch.ones(1, 3), response_length=torch.tensor([3.0]),
                          truncated=torch.tensor([False]), info={"reward": torch.tensor([1.0]),
                                                                 "truth": torch.tensor([self.weights])})
               for _ in prompts for _ in range(2)]
        return out, len(prompts), len(prompts) < num_prompts

    def make_experience_batch(self, samples):      # the model forwards (Ray) left out; OpenRLHF's concat kept
        return [Experience.concat_experiences(samples, 0)]

    def async_run_method_batch(self, method_name, experience):
        self.pending += experience
        return []

    def async_run_method(self, method_name, **kwargs):
        if method_name == "broadcast_to_vllm":
            self.weights = self.fits
            return []
        # fit: the replay buffer's split and re-batching (OpenRLHF's), then the loss's input
        for batch in self.pending:
            experience = make_experience_batch(split_experience_batch(batch))
            given = inputs.staleness(experience, self.args)
            assert given.shape == experience.action_mask.shape
            self.seen += [(row[0].item(), float(self.fits - t)) for row, t in zip(given, experience.info["truth"])]
        self.pending, self.fits = [], self.fits + 1
        return [{}]


def args(queue_size, freezing=-1):
    ns = types.SimpleNamespace
    return ns(train=ns(async_enable=True, num_episodes=1, dynamic_batch_enable=False, async_queue_size=queue_size),
              rollout=ns(batch_size=1, n_samples_per_prompt=2, vllm_generate_batch_size=2),
              vllm=ns(enable_sleep=False), algo=ns(dynamic_filtering_enable=False), ds=ns(enable_sleep=False),
              critic=ns(freezing_steps=freezing), eval=ns(steps=float("inf")), data=ns(disable_fast_tokenizer=False))


@pytest.mark.parametrize("queue_size, freezing", [(1, -1), (2, -1), (3, -1), (2, 2)])
def test_async_staleness_is_the_trainings_between_the_weights_that_sampled_and_those_trained(queue_size, freezing,
                                                                                               monkeypatch):
    """7 steps of one prompt and 2 responses, vLLM called for 2 prompts at a time (the second
    waits in SamplesGenerator's buffer); --critic.freezing_steps 2: the first 3 steps leave the
    actor (and its version) as it was."""
    a, prompts = args(queue_size, freezing), [f"p{i}" for i in range(7)]
    pipe = Pipeline()
    pipe.args = a
    loader = type("Loader", (), {"__len__": lambda s: len(prompts), "__iter__": lambda s: iter(prompts),
                                 "state_dict": lambda s: {}})()
    monkeypatch.setattr(ray, "get", lambda x: x)
    monkeypatch.setattr(ppo_trainer_async, "get_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(ppo_trainer_async, "prepare_datasets", lambda strategy, tok: (loader, None, 7))
    monkeypatch.setattr(samples_generator.SamplesGenerator, "_generate_vllm", pipe.vllm)
    strategy = types.SimpleNamespace(args=a)
    lock, rollouts, slots = Handle(ppo_trainer_async.VLLMLock.__ray_actor_class__()), queue.Queue(queue_size), \
        queue.Queue(queue_size)
    for _ in range(queue_size):
        slots.put(0)
    counter = Handle(versions._Versions())
    generator = ppo_trainer_async.GenerateSamplesActor.__ray_actor_class__(
        "model", strategy, [object()], vllm_lock=lock, rollout_queue=rollouts, rollout_slots=slots)
    # its __init__ builds models and loggers: set what fit reads
    trainer = object.__new__(ppo_trainer_async.TrainingActor.__ray_actor_class__)
    trainer.__dict__.update(args=a, strategy=strategy, vllm_lock=lock, _partial_rollout=False, rollout_queue=rollouts,
                            rollout_slots=slots, wandb_logger=None, tensorboard_logger=None, vllm_engines=[object()],
                            experience_maker=pipe, actor_model_group=pipe, critic_model_group=None,
                            tokenizer=types.SimpleNamespace(decode=lambda *a, **k: ["text"]),
                            kl_ctl=types.SimpleNamespace(value=0.0), save_logs_and_checkpoints=lambda *a: None)
    versions.install_generator(generator, counter)      # what drpo-train's PPOTrainerAsync runs in each actor
    versions.install_training(trainer, counter)
    failed = []

    def generate():
        try:
            generator.fit(0, 0)
        except BaseException as e:     # the trainer waits on the queue: end it, then raise here
            failed.append(e)
            rollouts.put("done")
    thread = threading.Thread(target=generate)
    thread.start()
    trainer.fit(0)
    thread.join(30)
    if failed:
        raise failed[0]
    # the frozen steps' samples stay in the actor's buffer (OpenRLHF clears it after a fit), trained at the first
    assert pipe.fits == 7 - (freezing + 1) and len(pipe.seen) == 14
    assert [given for given, _ in pipe.seen] == [truth for _, truth in pipe.seen], pipe.seen
    if freezing < 0:    # the second batch came from the first vLLM call's buffer, at version 0, trained at 1
        assert pipe.seen[2][1] == 1.0


def test_a_sample_without_its_version_is_refused_at_the_trainer_and_at_the_loss():
    sample = Experience(sequences=torch.zeros(1, 4), action_mask=torch.ones(1, 3), info={})
    with pytest.raises(RuntimeError, match="without the policy version that sampled it"):
        versions.tag_staleness([sample], 3)
    with pytest.raises(RuntimeError, match="asynchronous experience of 1 samples has no staleness in its info"):
        inputs.staleness(sample, args(1))
