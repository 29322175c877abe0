"""The Ray actor drpo-train's launcher uses in place of OpenRLHF's PolicyModelActor.

Subclassing the Ray actor class itself raises, so this subclasses the class underneath
(`__ray_actor_class__`), lets OpenRLHF build its model and trainer, then installs the
compiled objective where ActorPPOTrainer calls its policy loss, and (--drpo.chunked_logprobs)
the forward that scores log-probs from hidden states in chunks (logprobs.py)."""
from __future__ import annotations

import contextlib
import functools
import json
import math

import ray
from openrlhf.trainer.ray import ppo_actor
from openrlhf.trainer.ray.launcher import ReferenceModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from openrlhf_drpo.hosts.openrlhf import controls, cpu_mode, inputs, logprobs, support


def build_loss(spec):
    """The ObjectiveLoss for a spec shipped in the args (its text, not a path)."""
    from dsl import parse
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    spec = json.loads(spec) if isinstance(spec, str) else spec
    obj = parse(spec["source"], spec["path"]).with_overrides(spec["params"], spec["options"])
    return ObjectiveLoss(obj)


def _merge(row: dict, extremes: dict, dead: bool) -> None:
    """Fold one micro-batch's extremes into its optimizer step's row."""
    row["dead"] = row.get("dead", True) and dead
    if "ratio_min" in extremes:
        row["ratio_min"] = min(row.get("ratio_min", math.inf), extremes["ratio_min"])
        row["ratio_max"] = max(row.get("ratio_max", -math.inf), extremes["ratio_max"])
    for key in ("tokens", "past_boundary", "ratio_sum", "ratio_sq_sum"):       # sums over the micro-batches
        if key in extremes:
            row[key] = row.get(key, 0) + extremes[key]
    if extremes.get("max_token_weight", -1.0) > row.get("max_token_weight", -1.0):
        row["max_token_weight"] = extremes["max_token_weight"]
        row["mu_at_max_token_weight"] = extremes["mu_at_max_token_weight"]


def install_objective(trainer, spec, step_log=None):
    """Replace the trainer's PolicyLoss by the compiled objective, and route the objective's
    per-step metrics into experience.info, where OpenRLHF picks up 0-d tensors for its logs
    (reduced over ranks like its own ppo_kl and clip_ratio). OpenRLHF averages every metric
    over a step's updates, so drpo_ratio_max is set to the step's true maximum afterwards.
    With `step_log` (a path), rank 0 appends one JSON line per optimizer step (its
    micro-batches folded together): what drpo-lab reads (the gradient norm before clipping,
    r's range, the largest per-token weight). `step` counts ppo_train calls in this run.
    Each step's loss call gets the objective's other inputs (inputs.supplied); an objective that
    reads π_ref (or its top-k) is the KL trained, so OpenRLHF's own KL loss (--algo.kl.use_loss) gets a
    coefficient of 0 (still logged as kl); with group reductions, ppo_train's micro-batches are
    whole groups (inputs.whole_groups). An objective with memory: its state is updated after each optimizer
    step (DeepSpeed's, where its engine's global_steps moves) over the data-parallel ranks, and logged
    (controls.py)."""
    loss_fn = build_loss(spec)
    loss_fn.track_extremes = bool(step_log)
    trainer.actor_loss_fn = loss_fn
    # a lab installs one objective per run on the same trainer: wrap OpenRLHF's methods, never our wrappers
    if not hasattr(trainer, "_drpo_originals"):
        trainer._drpo_originals = trainer.training_step, trainer.ppo_train
    original_step, original_train = trainer._drpo_originals
    state = {"step": 0, "micro": 0, "update": 0, "ratio_max": [], "row": {}, "controls": {}}
    engine = trainer.actor.model      # the DeepSpeed engine: its global_steps counts the optimizer's steps
    if loss_fn.controller is not None and not hasattr(engine, "global_steps"):
        raise RuntimeError(f"openrlhf-drpo: objective '{loss_fn.objective.name}' updates its state after each "
                           f"optimizer step, which this actor's {type(engine).__name__} does not count")
    # π_ref in the objective (its log-probs, or its top-k in a vocabulary sum): the objective is the KL trained
    reads_ref = inputs.trains_the_kl(loss_fn)

    def optimizer_stepped(micro_index) -> bool:       # as ActorPPOTrainer.training_step decides it
        if trainer.args.train.dynamic_batch_enable:
            return bool(trainer.replay_buffer.dynamic_optimizer_step[micro_index])
        return state["micro"] % trainer.strategy.accumulated_gradient == 0

    @functools.wraps(original_step)
    def training_step(experience, kl_ctl, micro_index, *args, **kwargs):
        loss_fn.sink = experience.info
        steps = getattr(engine, "global_steps", None)
        try:
            with inputs.supplied(loss_fn, trainer, experience):
                status = original_step(experience, 0.0 if reads_ref else kl_ctl, micro_index, *args, **kwargs)
        finally:
            loss_fn.sink = None
        if loss_fn.controller is not None and engine.global_steps != steps:       # DeepSpeed stepped: after it
            state["controls"] = loss_fn.end_step(controls.data_parallel_group(trainer.strategy))
        state["ratio_max"].append(float(loss_fn.metrics.ratio_max))
        if step_log:
            keep = experience.action_mask.bool()
            _merge(state["row"], loss_fn.extremes, bool((experience.advantages[keep] == 0).all()))
            state["micro"] += 1
            if optimizer_stepped(micro_index):
                grad_norm = status["metrics"].get("actor_grad_norm")
                row = {"step": state["step"] + 1, "update": state["update"], **state["row"], **state["controls"],
                       "grad_norm": None if grad_norm is None else float(grad_norm)}
                if trainer.strategy.is_rank_0():
                    with open(step_log, "a") as f:
                        f.write(json.dumps(row) + "\n")
                state["update"], state["row"] = state["update"] + 1, {}
        return status

    @functools.wraps(original_train)
    def ppo_train(*args, **kwargs):
        state.update(ratio_max=[], micro=0, update=0, row={}, controls={})
        with contextlib.ExitStack() as stack:
            if "groups" in loss_fn.inputs():
                stack.enter_context(inputs.whole_groups(ppo_actor))
            if "batch" in loss_fn.inputs() and trainer.strategy.accumulated_gradient > 1:
                stack.enter_context(inputs.step_statistics(ppo_actor, trainer, loss_fn))
            status = original_train(*args, **kwargs)
        if state["ratio_max"]:
            status["drpo_ratio_max"] = trainer.strategy.all_reduce(max(state["ratio_max"]), op="max")
        if loss_fn.controller is not None:      # the same on every rank: the values for the coming step
            status.update(loss_fn.controller.logged())
        state["step"] += 1
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
        drpo = strategy.args.drpo
        if getattr(drpo, "chunked_logprobs", "on") == "on":
            strategy.print(logprobs.install(self.actor, getattr(drpo, "logprob_chunk", logprobs.CHUNK)))
        self.drpo_loss = install_objective(self.trainer, strategy.args.drpo.spec,
                                           getattr(strategy.args.drpo, "step_log", None))
        strategy.print(f"openrlhf-drpo: policy loss is {self.drpo_loss!r}")
        line = controls.restore(self.drpo_loss, self.checkpoint_states, f"{strategy.args.ckpt.path}/_actor")
        if line:
            strategy.print(line)
        if getattr(drpo, "vocab_topk", None) and getattr(self.actor, "drpo_chunk", None) is None:
            raise RuntimeError("openrlhf-drpo: the objective's vocabulary sums need the policy's log-probs on π_ref's "
                               "top-k from the chunked forward, which this actor cannot take "
                               f"({logprobs.unsupported(self.actor)})")
        return out

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """OpenRLHF's actor checkpoint, its client state also holding the objective's state (if it has memory)."""
        state = self.drpo_loss.control_state()
        if state is not None:
            client_states = {**(client_states or {}), controls.KEY: state}
        return super().save_checkpoint(tag, client_states, metric_value, metric_key)

    def append(self, experience):
        """OpenRLHF's append, keeping each sample's group id where the objective has group
        reductions (the replay buffer drops the rollout index it is read from), and π_ref's top-k
        in experience.info where it has vocabulary sums (inputs.unpack_support)."""
        if "groups" in self.drpo_loss.inputs():
            inputs.tag_groups(experience, self.trainer.args.rollout.n_samples_per_prompt)
        if set(inputs.VOCABULARY_INPUTS) & set(self.drpo_loss.inputs()):
            inputs.unpack_support(experience, self.trainer.args.drpo.vocab_topk)
        return super().append(experience)

    def drpo_begin_run(self, spec, step_log, seed) -> None:
        """drpo-lab: start a run on this trainer as if it were new: the initial weights (the
        fp32 master copy rebuilt from them), an empty optimizer state, the scheduler's first
        state, an empty replay buffer, the run's seed and objective."""
        import copy
        import transformers
        engine, zero = self.actor.model, self.actor_optim
        inner = getattr(zero, "optimizer", zero)      # under ZeRO, the torch optimizer itself
        if not hasattr(self, "_drpo_initial"):      # the first run: nothing has trained yet
            # (ZeRO already stepped the optimizer once at construction to create its state:
            # that state, not an empty one, is what a new run starts from)
            self._drpo_initial = copy.deepcopy((engine.module.state_dict(), inner.state_dict(),
                                                self.actor_scheduler.state_dict()))
        weights, optim, scheduler = copy.deepcopy(self._drpo_initial)
        engine.module.load_state_dict(weights)
        if hasattr(zero, "refresh_fp32_params"):      # ZeRO keeps fp32 masters that overwrite the weights
            zero.refresh_fp32_params()
        inner.load_state_dict(optim)
        self.actor_scheduler.load_state_dict(scheduler)
        engine.global_steps = engine.global_samples = engine.micro_steps = 0
        self.trainer.replay_buffer.clear()
        transformers.set_seed(seed)
        self.drpo_loss = install_objective(self.trainer, spec, step_log)

    def drpo_objective(self, spec=None) -> dict:
        """What this actor trains with (building it from `spec` if it has no model yet)."""
        loss = getattr(self, "drpo_loss", None) or build_loss(spec)
        obj = loss.objective
        return {"name": obj.name, "objective": obj.canonical().splitlines()[-1],
                "params": {k: float(v) for k, v in obj.params.items()}, "options": obj.options,
                "loss": type(loss).__name__, "fused": loss.fused}


DrpoPolicyModelActor = ray.remote(num_gpus=1)(_DrpoPolicyModelActor)


class _DrpoReferenceModelActor(ReferenceModelActor.__ray_actor_class__):
    """OpenRLHF's reference model actor; with --drpo.vocab_topk K (an objective whose vocabulary sums
    read π_ref's top-k), its forward also gives each response token's top-K ids and log-probs, in
    chunks from the hidden states (support.reference_topk), packed where its log-probs travel; with
    --drpo.teacher, π_ref is that model in place of the actor's initial weights."""

    def init_model_from_pretrained(self, strategy, pretrain):
        drpo = strategy.args.drpo
        teacher = getattr(drpo, "teacher", None)
        if teacher:
            support.refuse_other_tokenizer(teacher, pretrain)
        out = super().init_model_from_pretrained(strategy, teacher or pretrain)
        self.drpo_vocab_topk = getattr(drpo, "vocab_topk", None)
        if teacher:
            strategy.print(f"openrlhf-drpo: π_ref is the teacher {teacher} (--drpo.teacher)")
        if self.drpo_vocab_topk:
            line = logprobs.install(self.model, getattr(drpo, "logprob_chunk", logprobs.CHUNK))
            if getattr(self.model, "drpo_chunk", None) is None:
                raise RuntimeError(f"openrlhf-drpo: π_ref's top-k is scored from the hidden states in chunks: {line}")
            strategy.print(f"openrlhf-drpo: π_ref's top-{self.drpo_vocab_topk} at each response token from the "
                           "reference model's hidden states (--drpo.vocab_topk)")
        return out

    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False, packed_seq_lens=None,
                mm_train_inputs_list=None):
        if not getattr(self, "drpo_vocab_topk", None):
            return super().forward(sequences, action_mask, attention_mask, return_output, packed_seq_lens,
                                   mm_train_inputs_list)
        device = next(self.model.parameters()).device
        packed = support.reference_topk(self.model, sequences.to(device), action_mask.to(device),
                                        attention_mask.to(device), self.drpo_vocab_topk)
        return packed.to("cpu")


DrpoReferenceModelActor = ray.remote(num_gpus=1)(_DrpoReferenceModelActor)
