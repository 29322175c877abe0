"""drpo-train and an objective with memory (a controlled parameter `β ← rule in [lo, hi]`, or `step`):
the actor's ObjectiveLoss holds the state (core.controls). After each optimizer step (DeepSpeed's, at the
accumulation's boundary: its engine's global_steps moves) every data-parallel rank calls end_step with the
data-parallel group, so all hold the same values; ppo_train's status logs them (drpo_<name>, drpo_step);
the actor's checkpoint saves them in DeepSpeed's client state (KEY) and a resumed run restores them.
What drpo-train cannot do so is refused by name, before Ray starts (refuse_at_launch)."""
from __future__ import annotations

from dsl.controls import statistics
from dsl.names import display_name

KEY = "drpo_control"       # the controlled state's key in the actor checkpoint's client state


def _memory(loss) -> str:
    """The objective's memory, in words, for the messages."""
    names = ", ".join(display_name(n) for n in loss.objective.controls)
    return f"controlled parameter{'s' * (len(loss.objective.controls) > 1)} {names}" if names else "step counter"


def refuse_at_launch(loss, ns) -> None:
    """The command lines under which drpo-train cannot update, save or restore the objective's state."""
    if loss.controller is None:
        return
    g = lambda flag, default=None: getattr(ns, flag, default)       # noqa: E731  (OpenRLHF's flat args)
    who = f"drpo-train: error: objective '{loss.objective.name}' has a {_memory(loss)}"
    ring, tp = g("ds.ring_attn_size", 1), g("ds.tensor_parallel_size", 1)
    if statistics(loss.objective.controls) and (ring > 1 or tp > 1):
        # ranks of one ring or tensor-parallel group hold the same samples: their sum would count them
        # twice unless taken over the data-parallel group only, which no test runs (fail closed)
        raise SystemExit(f"{who}, whose rule's batch statistics drpo-train sums over data-parallel ranks only "
                         f"(--ds.ring_attn_size {ring}, --ds.tensor_parallel_size {tp} are untested with them): "
                         "set both to 1")
    samples = g("rollout.batch_size", 0) * g("rollout.n_samples_per_prompt", 1)
    batch = g("train.batch_size", 0)
    if not g("train.dynamic_batch_enable") and batch and samples % batch:
        # OpenRLHF saves its checkpoint after each rollout's training: a step left open across two rollouts
        # would have statistics pending at the save, and a resumed run would lose them
        raise SystemExit(f"{who}, whose state is saved with each checkpoint between optimizer steps, but a rollout of "
                         f"--rollout.batch_size {g('rollout.batch_size')} × --rollout.n_samples_per_prompt "
                         f"{g('rollout.n_samples_per_prompt')} = {samples} samples is not whole optimizer steps of "
                         f"--train.batch_size {batch}: make {samples} a multiple of it")


def data_parallel_group(strategy):
    """The ranks whose statistics a step sums: OpenRLHF's data-parallel mesh dimension (all ranks
    but where ring attention or tensor parallelism, refused above, group them)."""
    import torch
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    mesh = getattr(strategy, "ds_device_mesh", None)
    return mesh["dp"].get_group() if mesh is not None else torch.distributed.group.WORLD


def restore(loss, checkpoint_states: dict, where: str) -> str | None:
    """A resumed run's state (the line to print), from the actor checkpoint's client state; a
    checkpoint without one refused where the objective has memory (its values would restart)."""
    if not checkpoint_states:       # a new run: nothing was loaded
        return None
    state = checkpoint_states.get(KEY)
    try:
        if loss.controller is not None and state is None:
            raise ValueError(f"objective '{loss.objective.name}' has a {_memory(loss)}, but the checkpoint holds no "
                             "state for it (saved by a run of another objective, or before drpo-train saved it): "
                             "its values would restart; resume with the objective the checkpoint was saved with, "
                             "or start a new run")
        loss.load_control_state(state)
    except ValueError as e:
        raise RuntimeError(f"openrlhf-drpo: resuming from {where}: {e}") from None
    if state is None:
        return None
    values = ", ".join(f"{display_name(k)} = {v:g}" for k, v in state["values"].items())
    return f"openrlhf-drpo: resumed objective '{loss.objective.name}' at step {state['step']}" + \
        (f" ({values})" if values else "")
