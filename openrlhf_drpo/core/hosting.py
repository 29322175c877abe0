"""The calls a host makes on a CompiledLoss besides forward: what the objective reads that the host
must give (inputs, the one refusal message, what a host withholds), the batch statistics of an
optimizer step of several micro-batches, and, for an objective with memory (dsl.controls), the step's
update and the state a checkpoint keeps. CompiledLoss inherits them; a host adapter overrides the
class attributes and `lacks`."""
from __future__ import annotations

from openrlhf_drpo.core.codegen import compile_objective
from dsl.operations import OPS
from openrlhf_drpo.core.collectives import BatchStatistics


class HostCalls:
    argument_names: dict = {}      # the host's names for forward's arguments, for its error messages
    provides: dict | None = None   # a host's: the inputs()' keys it gives, with how (refuse_unprovided)
    host = ""                      # a host's: the name its refusals begin with

    def inputs(self) -> dict:
        """What the objective reads beyond log π, μ, A and the mask, with what reads it: the one list
        a host's `provides` answers (rollout_log_probs, ref_log_probs, entropy, sum_pi_sq, groups, batch)."""
        return dict(self._inputs)

    def refuse_missing(self, missing: dict, who: str = "") -> None:
        """The one refusal message: an input the objective reads that `missing` maps to why it is not given."""
        for key, why in self.inputs().items():
            if key in missing:
                raise ValueError(f"{who + ': ' if who else ''}objective '{self.objective.name}' uses {why}, "
                                 f"but {missing[key]}")

    def batch_statistics(self, process_group: object | None = None) -> BatchStatistics | None:
        """For an optimizer step of several micro-batches: the step's batch reductions, exact, summed
        over `process_group`'s ranks (core.collectives.BatchStatistics says how a host runs them);
        None where the objective has no batch reduction (nothing to pass)."""
        return _batch_statistics(self, process_group) if "batch" in self.inputs() else None

    def lacks(self, config: object) -> dict:      # a host's: what it withholds under `config` (None: any), with why
        return {}

    def end_step(self, process_group: object | None = None) -> dict[str, float]:
        """For an objective with memory (a controlled parameter or `step`), after each optimizer step:
        the step's statistics summed over `process_group`'s ranks (default: all, where torch.distributed
        runs), each controlled parameter updated, the step counter advanced, the objective recompiled
        at the new values. Returns what a host logs: drpo_<name> and drpo_step ({} without memory)."""
        if self.controller is None:
            return {}
        logged = self.controller.end_step(process_group)
        self._rebind()
        return logged

    def control_state(self) -> dict | None:
        """The state to save with a host's checkpoint (after end_step): step and values; None without memory."""
        return None if self.controller is None else self.controller.state_dict()

    def load_control_state(self, state: dict | None) -> None:
        """Resume from control_state()'s dict: the step and values it holds, the objective recompiled at them."""
        if self.controller is None:
            if state is not None:
                raise ValueError(f"{type(self).__name__}: objective '{self.objective.name}' has no controlled "
                                 "parameter or step, but a saved state was given")
            return
        self.controller.load_state_dict(state)
        self._rebind()

    def _rebind(self) -> None:
        self.objective = self.controller.objective()
        self.generated = compile_objective(self.objective)
        self.source = self.generated.source
        self._kernels = {}


def _batch_statistics(loss, process_group) -> BatchStatistics:
    # the passes carry sums only: an order statistic of one micro-batch is not the step's
    order = sorted({n.op for n in loss.objective.expr.walk() if n.op in OPS and OPS[n.op].over == "batch"
                    and OPS[n.op].reduce not in ("sum", "mean", "count")})
    if order:
        raise ValueError(f"{type(loss).__name__}: {', '.join(order)} over an optimizer step of several "
                         "micro-batches is not supported: the no-grad passes sum each micro-batch's "
                         "statistics, and an order statistic is not a sum of its parts; train with one "
                         "micro-batch per step (drpo-train: --train.micro_batch_size × ranks = "
                         "--train.batch_size; TRL: gradient_accumulation_steps=1)")
    return BatchStatistics(process_group, loss.generated.batch_depth)
