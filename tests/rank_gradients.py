"""A drpo-train plugin (--drpo.plugin rank_gradients, with tests/ on PYTHONPATH) for
tests/test_two_ranks.py: every optimizer step's whole actor gradient, as DeepSpeed reduced it over
the data-parallel ranks, saved before the step to config["out"]/step{k}.pt with the number of
ranks, the step's rollout to rollout{k}.pt, and rollouts that do not depend on the trainer.
Nothing else of the run changes.

- trainer: OpenRLHF's single controller, which before fit() has each policy rank wrap its
  strategy's optimizer_step (at the accumulation's boundary, where DeepSpeed steps) (through Ray's __ray_call__: the policy actor class stays drpo-train's).
  Every rank gathers (ZeRO-2 keeps a partition each: safe_get_full_grad all-reduces them); rank 0 saves.
- rollout_actor: drpo-lab's seeded vLLM actor (a sample's seed from its prompt and index, not from
  the engine's order). With OPENRLHF_DRPO_SKIP_VLLM_RELOAD=1 the engine keeps its first weights,
  so a one-rank and a two-rank run sample the same rollouts at every step.
"""
import itertools
import os

import torch


def rollout_actor(base, config):
    from openrlhf_drpo.lab import pipe
    return pipe.rollout_actor(base, {})


def record_gradients(policy_actor, out: str) -> None:
    """Runs in each policy rank's process, on drpo-train's policy actor."""
    from deepspeed.utils import safe_get_full_grad
    strategy, steps = policy_actor.trainer.strategy, itertools.count(1)
    optimizer_step = strategy.optimizer_step

    def recording_step(optimizer, model, scheduler, **kwargs):
        # OpenRLHF calls it after every micro-batch; DeepSpeed steps (and has the step's gradient)
        # only at the accumulation's boundary (test_accumulation_train: 4 micro-batches a step)
        if not model.model.is_gradient_accumulation_boundary():
            return optimizer_step(optimizer, model, scheduler, **kwargs)
        # the same collectives on every rank, parameter by parameter, before DeepSpeed steps
        grads = [safe_get_full_grad(p).detach().float().reshape(-1) for p in model.model.parameters()]
        step = next(steps)
        if torch.distributed.get_rank() == 0:       # with the ranks that made it
            torch.save({"ranks": torch.distributed.get_world_size(), "grad": torch.cat(grads)},
                       os.path.join(out, f"step{step}.pt"))
        return optimizer_step(optimizer, model, scheduler, **kwargs)
    strategy.optimizer_step = recording_step


def trainer(base, config):
    import ray

    class RecordingTrainer(base.__ray_actor_class__):
        def fit(self, *args, **kwargs):
            ray.get([actor.__ray_call__.remote(record_gradients, config["out"])
                     for actor in self.actor_model_group._actor_handlers])
            return super().fit(*args, **kwargs)

        def train_step(self, rollout_samples, global_step):
            # one order whatever order the engine finished them in (drpo-lab's): the same
            # samples on the same rank in every run
            rollout_samples = sorted(rollout_samples, key=lambda e: (e.prompts, e.sequences.tolist()))
            torch.save([(e.prompts, e.sequences.tolist()) for e in rollout_samples],
                       os.path.join(config["out"], f"rollout{global_step + 1}.pt"))
            return super().train_step(rollout_samples, global_step)
    return ray.remote(RecordingTrainer)
