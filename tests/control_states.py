"""A drpo-train plugin (--drpo.plugin control_states, with tests/ on PYTHONPATH) for
tests/test_train_controls.py: each policy rank appends one JSON line per optimizer step to
config["out"]/controls{rank}.jsonl: its own (Σ, count) of the rule's statistics before they are summed
over the ranks, the values its training calls of that step read, the sum of their losses (the step's loss
on the rank, whatever its micro-batches), and what end_step returned. Rollouts
that do not depend on the engine's order (drpo-lab's seeded vLLM actor, samples sorted as in
tests/rank_gradients.py), so that a run and its resumed half train on the same samples.
Nothing else of the run changes."""
import json
import os

import torch


def rollout_actor(base, config):
    from openrlhf_drpo.lab import pipe
    return pipe.rollout_actor(base, {})


def record_controls(policy_actor, out: str) -> None:
    """Runs in each policy rank's process, on drpo-train's policy actor."""
    loss, rank = policy_actor.drpo_loss, torch.distributed.get_rank()
    controller, forward, read, losses = loss.controller, loss.forward, [], []
    end_step = controller.end_step

    def reading_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if torch.is_grad_enabled():     # a training call: the values it reads, its loss
            read.append({k: float(loss.objective.params[k]) for k in controller.values})
            losses.append(float(out[0]))
        return out

    def recording_end_step(process_group=None):
        local = controller.pending.tolist() if controller.pending is not None else []
        row = {"rank": rank, "step": controller.step, "local": local, "read": list(read), "loss": sum(losses)}
        logged = end_step(process_group)
        read.clear()
        losses.clear()
        with open(os.path.join(out, f"controls{rank}.jsonl"), "a") as f:
            f.write(json.dumps({**row, "logged": logged}) + "\n")
        return logged
    loss.forward, controller.end_step = reading_forward, recording_end_step


def trainer(base, config):
    import ray

    class RecordingTrainer(base.__ray_actor_class__):
        def fit(self, *args, **kwargs):
            ray.get([actor.__ray_call__.remote(record_controls, config["out"])
                     for actor in self.actor_model_group._actor_handlers])
            return super().fit(*args, **kwargs)

        def train_step(self, rollout_samples, global_step):
            rollout_samples = sorted(rollout_samples, key=lambda e: (e.prompts, e.sequences.tolist()))
            return super().train_step(rollout_samples, global_step)
    return ray.remote(RecordingTrainer)
