"""The third version's inputs in drpo-train (issue 29): what OpenRLHF 0.11.2 gives each loss call
beside log π, μ and A, and the refusal at launch, naming the flags to set, of an objective whose
inputs the run would not give or whose group or batch reductions its micro-batches would split.

    π_ref      the reference model's log-probs (experience.base_action_log_probs): OpenRLHF makes
               them with --algo.kl.init_coef > 0 and passes them on only with --algo.kl.use_loss
    H          the actor's entropy, with its gradient (its forward computes it from the same
               logits or chunks as log π; drpo-train asks for it; --actor.entropy_coef ≠ 0 is refused)
    sum_π_sq   Σ_v π_v² from the same logits or chunks, without gradient
    groups     a response's rollout index // --rollout.n_samples_per_prompt, kept at append;
               ppo_train's micro-batches are whole groups, shuffled (GroupBatches)
    staleness  0 with the synchronous trainer; with --train.async_enable, each sample's policy
               versions behind the one training on it (versions.py), kept in experience.info
    π_ref_v    π_ref's top-k at each response token, ids and log-probs (--drpo.vocab_topk): the
               reference actor packs them beside its log-probs (support.reference_topk), the
               policy actor's append splits them into experience.info (unpack_support); π_v, log π
               on those ids with its gradient, from the training forward's hidden states
    batch      the optimizer step's batch over its micro-batches and the ranks: one micro-batch a step,
               summed over the ranks in the loss call; several, the step's totals from no-grad
               passes over its micro-batches before it trains (step_statistics)
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch

from openrlhf_drpo.core.boundary import turn_ids
from openrlhf_drpo.core.loss import refuse_unprovided
from openrlhf_drpo.hosts.openrlhf.support import policy_support

GROUP_KEY = "drpo_group"       # experience.info's per-sample group id, between append and the loss call
STALENESS_KEY = "drpo_staleness"    # its staleness in asynchronous mode (versions.py), logged as a metric
# experience.info's per-sample π_ref top-k [A, k] (ids, log-probs), between append and the loss call
VOCAB_IDS, VOCAB_REF = "drpo_vocab_ids", "drpo_vocab_ref"
VOCABULARY_INPUTS = ("vocab_log_probs", "vocab_ref_log_probs")


def trains_the_kl(loss) -> bool:
    """Whether the objective itself reads π_ref (or its top-k): its terms are then the KL trained and
    OpenRLHF's own KL loss gets a coefficient of 0. An update rule's statistic of π_ref is no such term
    (loss.inputs() lists what it reads): OpenRLHF's KL loss stays trained beside it."""
    return bool({"pi_ref", "pi_ref_v"} & loss.objective.names()) or loss.support is not None


def missing_at_launch(ns) -> dict:
    """ObjectiveLoss.lacks for a drpo-train command line: each input (or thing a loss call must
    hold whole) this run would not give, with the flags that would."""
    g, missing = functools.partial(getattr, ns), {}      # OpenRLHF's flat args at parse time
    if not (g("algo.kl.use_loss") and g("algo.kl.init_coef") > 0):
        missing["ref_log_probs"] = (
            "OpenRLHF passes the reference model's log-probs to the actor only with --algo.kl.use_loss and "
            "--algo.kl.init_coef > 0 (which creates the reference model): set both (the objective's terms in "
            "π_ref are then the KL trained; OpenRLHF's own KL loss is logged as kl, not trained)")
    if getattr(ns, "train.partial_rollout_enable", False):      # (absent where a test builds the namespace)
        missing["staleness"] = (
            "--train.partial_rollout_enable: OpenRLHF 0.11.2 pauses vLLM's generation for each weight broadcast and "
            "resumes it with the new weights (ppo_trainer_async.py:255-265), so one response mixes policy versions "
            "and its tokens' versions are not recorded: leave it off (--train.async_enable alone gives staleness)")
    missing.update(_vocabulary_missing(ns))
    if g("ds.packing_samples") or g("train.dynamic_batch_enable"):
        missing["sum_pi_sq"] = ("drpo-train computes Σ_v π_v² only on unpacked samples: turn off "
                                "--ds.packing_samples and --train.dynamic_batch_enable")
    # Ring attention (OpenRLHF's sequence parallelism) splits each packed micro-batch's tokens over
    # the ring group and all-gathers log π and H before the loss: every reduction along a response
    # sees it whole. The logits stay split (a response may straddle two ranks): Σ_v π_v² cannot.
    if g("ds.ring_attn_size") > 1:
        missing["sum_pi_sq"] = (f"--ds.ring_attn_size {g('ds.ring_attn_size')} splits each response's logits, "
                                "which Σ_v π_v² is read from, over the ring group (OpenRLHF gathers only the "
                                "log-probs and the entropy): set --ds.ring_attn_size 1")
    if g("train.dynamic_batch_enable"):
        why = "--train.dynamic_batch_enable repartitions the micro-batches by length: turn it off"
        return {**missing, "groups": why, "batch": why}
    ring, tp = g("ds.ring_attn_size"), g("ds.tensor_parallel_size")
    dp = g("actor.num_nodes") * g("actor.num_gpus_per_node") // ring // tp
    micro, batch = g("train.micro_batch_size"), g("train.batch_size")
    if ring > 1 or tp > 1:
        missing["batch"] = ("drpo-train sums a batch over all ranks as data-parallel ones: set --ds.ring_attn_size 1 "
                            "and --ds.tensor_parallel_size 1")
    elif batch % (micro * dp):
        missing["batch"] = (f"an optimizer step of --train.batch_size {batch} is not whole micro-batches of "
                            f"--train.micro_batch_size {micro} on each of {dp} data-parallel rank{'s' * (dp != 1)}: "
                            f"make --train.batch_size a multiple of {micro * dp}")
    n = g("rollout.n_samples_per_prompt")
    if micro % n:
        missing["groups"] = ("drpo-train shuffles whole prompts into micro-batches of --train.micro_batch_size "
                             f"{micro}: set it to a multiple of --rollout.n_samples_per_prompt {n}")
    elif dp > 1 and g("rollout.micro_batch_size") % n:
        missing["groups"] = ("each rank receives whole rollout micro-batches: set --rollout.micro_batch_size to a "
                             f"multiple of --rollout.n_samples_per_prompt {n}, so that each holds whole prompts")
    return missing


def _vocabulary_missing(ns) -> dict:
    """Why this command line gives no π_ref top-k (the first reason), or nothing: the reference model
    scores it with the chunked forward on unpacked samples, and it reaches the policy actor where
    OpenRLHF carries the reference log-probs (--algo.kl.use_loss)."""
    g = functools.partial(getattr, ns)
    why = None
    if g("drpo.vocab_topk", None) is None:
        why = ("the support's size k is the command line's: set --drpo.vocab_topk K (the k entries π_ref ranks "
               "highest at each token; the objective names no k)")
    elif not (g("algo.kl.use_loss") and g("algo.kl.init_coef") > 0):
        why = ("π_ref's top-k comes from OpenRLHF's reference model, which it creates with --algo.kl.init_coef > 0 "
               "and whose output reaches the actor only with --algo.kl.use_loss: set both (OpenRLHF's own KL loss "
               "is then logged as kl, not trained)")
    elif g("drpo.chunked_logprobs", "on") != "on":
        why = "drpo-train scores the support from the hidden states in chunks: leave --drpo.chunked_logprobs on"
    else:
        for flag, off in (("ds.packing_samples", False), ("train.dynamic_batch_enable", False),
                          ("ds.ring_attn_size", 1), ("ds.tensor_parallel_size", 1)):
            if g(flag, off) != off:
                why = (f"--{flag} {g(flag)}: drpo-train scores the support on unpacked, unsplit micro-batches in "
                       f"their rollout order: {'turn it off' if off is False else f'set --{flag} 1'}")
                break
    return {} if why is None else dict.fromkeys(VOCABULARY_INPUTS, why)


def unpack_support(experience, k: int) -> None:
    """At the policy actor's append: experience.base_action_log_probs as the reference actor packed it
    ([B, A, 1 + 2k], support.reference_topk) becomes OpenRLHF's [B, A] again, the top-k ids and
    log-probs going into experience.info, which OpenRLHF's replay buffer splits per sample."""
    packed = experience.base_action_log_probs
    shape = None if packed is None else list(packed.shape)
    if shape is None or len(shape) != 3 or shape[-1] != 1 + 2 * k:
        raise RuntimeError(f"openrlhf-drpo: the reference log-probs of this experience are {shape}, not [B, A, "
                           f"{1 + 2 * k}] with π_ref's top-{k} (--drpo.vocab_topk {k}): they must come from "
                           "drpo-train's reference actor")
    experience.base_action_log_probs = packed[..., 0].contiguous()
    experience.info[VOCAB_REF] = packed[..., 1:1 + k].contiguous()
    experience.info[VOCAB_IDS] = packed[..., 1 + k:].long()


def support_of(experience):
    """The micro-batch's π_ref top-k (ids, log-probs), each [B, W, k] at its action_mask's width W,
    taken out of experience.info (so OpenRLHF does not log them): each sample's rows from its first
    response token (the replay buffer trims responses' right padding, and pads the batch after them)."""
    width = experience.action_mask.shape[1]
    out = []
    for key in (VOCAB_IDS, VOCAB_REF):
        rows = experience.info.pop(key, None)
        if rows is None:
            raise RuntimeError("openrlhf-drpo: this experience has no π_ref top-k: an objective with a vocabulary "
                               "sum needs its experiences appended through the policy actor's append")
        rows = list(rows) if isinstance(rows, (list, tuple)) else list(rows.unbind(0))
        out.append(torch.stack([torch.nn.functional.pad(r[:width], (0, 0, 0, width - min(len(r), width)))
                                for r in rows]).to(experience.action_mask.device))
    return out


def refuse_at_launch(loss, ns) -> None:
    """drpo-train's refusal, before Ray starts, of an objective this command line cannot train."""
    try:
        refuse_unprovided(loss, ns)
    except ValueError as e:
        raise SystemExit(f"drpo-train: error: {e}") from None
    # an objective that reads H writes its own entropy terms: OpenRLHF's bonus on top would count one twice
    coef = getattr(ns, "actor.entropy_coef", None)
    if "entropy" in loss.inputs() and coef:
        raise SystemExit(f"drpo-train: error: objective '{loss.objective.name}' reads the entropy H and writes its own "
                         f"entropy terms, to which --actor.entropy_coef {coef} would add OpenRLHF's bonus a second "
                         "time: leave --actor.entropy_coef unset (or 0) and write the bonus into the objective")


def tag_groups(experience, n: int) -> None:
    """At the actor's append, while OpenRLHF's experience still has each sample's rollout index
    (its replay buffer drops it): the group id, index // n (the order its advantages' groups use)."""
    experience.info[GROUP_KEY] = [i // n for i in experience.index]


class GroupBatches:
    """ppo_train's micro-batches (a DataLoader's batch_sampler) of whole groups: the replay buffer's
    groups in a random order each epoch (OpenRLHF shuffles single samples), `size` samples a batch
    (a multiple of the group size), the last incomplete batch dropped as OpenRLHF drops it."""

    def __init__(self, items, size: int, shuffle: bool):
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(int(item.info[GROUP_KEY]), []).append(i)
        self.groups, self.size, self.shuffle = list(groups.values()), size, shuffle

    def __len__(self):
        return sum(map(len, self.groups)) // self.size

    def __iter__(self):
        order = torch.randperm(len(self.groups)).tolist() if self.shuffle else range(len(self.groups))
        flat = [i for g in order for i in self.groups[g]]
        return iter([flat[s:s + self.size] for s in range(0, len(self) * self.size, self.size)])


@contextlib.contextmanager
def whole_groups(module):
    """Within one ppo_train: the DataLoader it builds (`module.DataLoader`, OpenRLHF's ppo_actor's)
    takes its micro-batches from GroupBatches."""
    original = module.DataLoader

    def loader(dataset, batch_size, shuffle, drop_last, **kwargs):
        return original(dataset, batch_sampler=GroupBatches(dataset.items, batch_size, shuffle), **kwargs)
    module.DataLoader = loader
    try:
        yield
    finally:
        module.DataLoader = original


def group_ids(experience, n: int):
    """The micro-batch's [B] group ids, taken out of experience.info (so OpenRLHF does not log
    them), refused unless every prompt in it has all its n responses: never a group reduction
    over part of a group."""
    ids = experience.info.pop(GROUP_KEY, None)
    if ids is None:
        raise RuntimeError("openrlhf-drpo: this experience has no group ids: an objective with group reductions "
                           "needs its experiences appended through the policy actor's append (which keeps them)")
    ids = torch.as_tensor(ids, dtype=torch.long, device=experience.action_mask.device)
    counts = ids.unique(return_counts=True)[1]
    if bool((counts != n).any()):
        raise RuntimeError(f"openrlhf-drpo: a micro-batch holds {sorted(counts.tolist())} responses of its prompts, "
                           f"not {n} (--rollout.n_samples_per_prompt) each: a group reduction over part of a group "
                           "would be a different gradient")
    return ids


def staleness(experience, args):
    """The [B, T] staleness of a loss call's micro-batch: 0 in OpenRLHF's synchronous trainer
    (each rollout sampled by the weights its step starts from), each sample's own in its
    asynchronous one (tagged by versions.py's trainer)."""
    mask = experience.action_mask
    zeros = torch.zeros_like(mask, dtype=torch.float32)
    if not getattr(getattr(args, "train", None), "async_enable", False):
        return zeros
    per = experience.info.get(STALENESS_KEY)
    if isinstance(per, list):       # the replay buffer re-batches a sample's 0-d tensors as a list
        per = torch.stack([torch.as_tensor(x) for x in per]) if per else torch.zeros(0)
    if per is None or per.shape != mask.shape[:1]:
        raise RuntimeError(f"openrlhf-drpo: this asynchronous experience of {mask.shape[0]} samples has "
                           f"{'no staleness' if per is None else f'staleness {list(per.shape)}'} in its info: "
                           "its rollouts must come through drpo-train's asynchronous trainer (versions.py)")
    return zeros + per.to(mask.device, torch.float32)[:, None]


def sum_pi_sq_from_logits(logits):
    """Σ_v π_v² = exp(logsumexp(2z) − 2·logsumexp(z)) on the temperature-scaled fp32 logits z,
    without gradient (the objective reads it as a fixed input)."""
    with torch.no_grad():
        return torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))


@contextlib.contextmanager
def supplied(loss, trainer, experience):
    """For one OpenRLHF training step: loss.given holds what the objective reads beyond log π, μ and
    A, and the actor's forward (chunked or OpenRLHF's) also returns H and Σ_v π_v² where it reads them."""
    need = loss.inputs()
    given = {}
    if "ref_log_probs" in need:
        given["ref_log_probs"] = experience.base_action_log_probs
    if "groups" in need:
        given["groups"] = group_ids(experience, trainer.args.rollout.n_samples_per_prompt)
    if "turns" in need:     # the agent's action ranges are action_mask's runs; its gaps, the environment's tokens
        given["turns"] = turn_ids(experience.action_mask)
    if "staleness" in need:
        given["staleness"] = staleness(experience, trainer.args)
    ids = None
    if set(VOCABULARY_INPUTS) & set(need):
        ids, given["vocab_ref_log_probs"] = support_of(experience)
    if "batch" in need and getattr(loss, "statistics", None) is not None:
        given["process_group"] = loss.statistics       # the step's totals (step_statistics)
    elif "batch" in need and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        given["process_group"] = torch.distributed.group.WORLD
    actor = trainer.actor
    own = actor.__dict__.get("forward")       # logprobs.install's chunked forward, or None: Actor.forward
    if ids is not None and own is None:
        raise RuntimeError("openrlhf-drpo: the policy's log-probs on π_ref's top-k come from the chunked forward "
                           "(--drpo.chunked_logprobs on), which this actor does not have (its start-up line says why)")
    if {"entropy", "sum_pi_sq", "vocab_log_probs"} & set(need):
        inner = own or types.MethodType(type(actor).forward, actor)

        def forward(sequences, action_mask=None, *args, **kwargs):
            # the chunked forward scores Σ_v π_v² and the support in its chunks; OpenRLHF's returns the logits
            chunked = {"drpo_sum_pi_sq": "sum_pi_sq" in need} if own is not None else {}
            if "vocab_log_probs" in need:       # (refused by OpenRLHF's forward, which has no hidden states to give)
                chunked["drpo_extra"] = policy_support(actor, ids)
            out = inner(sequences, action_mask, *args, **{**kwargs, "return_entropy": True, "return_output": True,
                                                           **chunked})
            log_probs, output = out
            width = action_mask.shape[1]
            if "vocab_log_probs" in need:
                given["vocab_log_probs"] = output.drpo_extra
            if "entropy" in need:
                given["entropy"] = output.entropy[:, -width:]
            if "sum_pi_sq" in need:
                sq = getattr(output, "sum_pi_sq", None)
                given["sum_pi_sq"] = sum_pi_sq_from_logits(output["logits"][:, :-1][:, -width:]) if sq is None else sq
            return out if kwargs.get("return_output") else log_probs
        actor.forward = forward
    loss.given = given
    try:
        yield
    finally:
        loss.given = {}
        if own is None:
            actor.__dict__.pop("forward", None)
        else:
            actor.forward = own


@contextlib.contextmanager
def step_statistics(module, trainer, loss):
    """For ppo_train (`module`: OpenRLHF's ppo_actor): each optimizer step of several micro-batches
    first takes its batch statistics (core.collectives.BatchStatistics), in no-grad passes of the
    actor's forward and the loss over the step's micro-batches, summed over the ranks; its training
    calls then read them (supplied). The step's window is OpenRLHF's iter_grad_accum_global_norm's
    (the micro-batches that share one loss normalizer), each window the accumulation's length but
    for a last partial one (refused otherwise: a step split into windows would be another batch)."""
    original = module.iter_grad_accum_global_norm
    ranks = torch.distributed.group.WORLD if torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1 else None

    def windows(data_iter, strategy, accumulated, mask_fn):
        window, last = [], None
        for item, info in original(data_iter, strategy, accumulated, mask_fn):
            if window and info is not last:
                yield window, last
                window = []
            window.append(item)
            last = info
        if window:
            yield window, last

    def run(data_iter, strategy, accumulated, mask_fn):
        # one window ahead (its normalizer's collective comes earlier, on every rank alike): only
        # the last may be short
        steps = windows(data_iter, strategy, accumulated, mask_fn)
        current = next(steps, None)
        while current is not None:
            (window, info), current = current, next(steps, None)
            if current is not None and len(window) != accumulated:
                raise RuntimeError(f"openrlhf-drpo: an optimizer step's micro-batches came {len(window)} to a loss "
                                   f"normalizer, not {accumulated}: batch statistics over part of a step")
            loss.statistics = stats = loss.batch_statistics(ranks)
            try:
                for _ in stats.recording():
                    for item in window:
                        _no_grad_call(trainer, loss, item, info)
                for item in window:
                    yield item, info
            finally:
                loss.statistics = None

    module.iter_grad_accum_global_norm = run
    try:
        yield
    finally:
        module.iter_grad_accum_global_norm = original


def _no_grad_call(trainer, loss, item, info):
    """ActorPPOTrainer.training_step's forward and loss call on one micro-batch, without gradient,
    its backward or its step: what the batch statistics sum."""
    item.to_device(torch.cuda.current_device())
    trainer.actor.train()       # as training_step: the same forward (dropout included) as the training call
    kept = dict(item.info) if {GROUP_KEY, VOCAB_IDS} & set(item.info) else None    # the loss call takes them out
    with torch.no_grad(), supplied(loss, trainer, item):
        log_probs, _ = trainer.actor(item.sequences, item.action_mask, attention_mask=item.attention_mask,
                                     return_output=True, ring_attn_group=trainer.strategy.ring_attn_group,
                                     return_entropy=trainer.args.actor.entropy_coef is not None)
        loss(log_probs, item.action_log_probs, item.advantages, action_mask=item.action_mask,
             rollout_log_probs=item.rollout_log_probs, **info)
    if kept is not None:
        item.info.update(kept)
