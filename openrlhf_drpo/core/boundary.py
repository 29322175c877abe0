"""The loss core's tensor boundary: every input checked before anything is computed."""
from __future__ import annotations

import math

import torch


def check_inputs(who: str, names: dict, tensors: dict, mask_values: bool = True) -> None:
    """The tensor boundary: every per-token input is a tensor of log_probs' shape [batch, tokens]
    on its device, floating point (the mask: bool, integer or floating, holding 0 and 1 only),
    or a message naming the tensor, its shape and the fix. `names` maps each argument to the
    host's name for it (ObjectiveLoss calls the mask action_mask). Metadata only, except the
    mask's values, which mask_values=False leaves to the caller (the sync-free kernels check them
    in the pass that reads the mask: refuse_bad_mask)."""
    def fail(msg):
        raise ValueError(f"{who}: {msg}")
    name = lambda key: names.get(key, key)   # noqa: E731
    logp = tensors["log_probs"]
    if not isinstance(logp, torch.Tensor):
        fail(f"{name('log_probs')} must be a torch.Tensor, got {type(logp).__name__}")
    shape = list(logp.shape)
    if logp.dim() != 2:
        fail(f"{name('log_probs')} is {shape}: the loss takes [batch, tokens] (one response: "
             f"{name('log_probs')}.unsqueeze(0))")
    for key, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            fail(f"{name(key)} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
        if list(x.shape) != shape:
            per_response = (x.dim() == 1 and x.shape[0] == shape[0]) or list(x.shape) == [shape[0], 1]
            fix = (f"expand per-response {name(key)} with {name(key)}"
                   f"{'.unsqueeze(-1)' if x.dim() == 1 else ''}.expand_as({name('log_probs')})"
                   if per_response and key in ("advantages", "weights") else
                   f"every per-token input has {name('log_probs')}' shape [batch, tokens]")
            fail(f"{name(key)} is {list(x.shape)}, {name('log_probs')} {shape}: {fix}")
        if x.device != logp.device:
            fail(f"{name(key)} is on {x.device}, {name('log_probs')} on {logp.device}: move it with "
                 f"{name(key)}.to({name('log_probs')}.device)")
        if key != "mask" and not x.is_floating_point():
            fail(f"{name(key)} is {x.dtype}: pass floating-point values ({name(key)}.float())")
    mask = tensors.get("mask")
    if mask is None or mask.dtype == torch.bool:
        return
    if mask.is_complex():
        fail(f"{name('mask')} is {mask.dtype}: pass a bool or 0/1 mask")
    if mask_values:
        refuse_bad_mask(who, names, mask, binary(mask))


def binary(mask):
    """Whether the mask holds 0 and 1 only, a 0-d bool tensor (None for a bool mask)."""
    return None if mask.dtype == torch.bool else ((mask == 0) | (mask == 1)).all()


def refuse_bad_mask(who: str, names: dict, mask, ok) -> None:
    """The error for a mask holding values other than 0 and 1, where `ok` (binary(mask)) is
    false: read on the CPU; on CUDA an asynchronous device assert (no host sync)."""
    if ok is None:
        return
    name = names.get("mask", "mask")
    msg = (f"{who}: {name} holds values other than 0 and 1{{}}: it selects tokens (1 = a response token, "
           f"0 = padding); pass per-token weights as Aggregation(weights=...), or ({name} != 0) "
           "to keep every token whose entry is not 0")
    if mask.is_cuda:
        torch._assert_async(ok, msg.format(""))
    elif not ok:
        raise ValueError(msg.format(f" ({mask[(mask != 0) & (mask != 1)][0].item()!r})"))


def check_groups(who: str, names: dict, groups, logp) -> None:
    """The group ids: one integer per response ([batch]) on log_probs' device, or a message
    naming the tensor, its shape and the fix."""
    if groups is not None:
        _check_ids(who, names, "groups", groups, logp, [logp.shape[0]], f"{logp.shape[0]} group ids",
                   "group", "response", "the responses of one prompt share an id")


def check_turns(who: str, names: dict, turns, logp) -> None:
    """The turn ids: integers of log_probs' shape [batch, tokens] on its device (equal ids within a
    response are one turn), or a message naming the tensor, its shape and the fix."""
    if turns is not None:
        _check_ids(who, names, "turns", turns, logp, list(logp.shape), f"turn ids {list(logp.shape)}",
                   "turn", "token", "a response's tokens of one turn share an id")


def _check_ids(who, names, key, ids, logp, shape, count, kind, per, share) -> None:
    name, lp = names.get(key, key), names.get("log_probs", "log_probs")
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{who}: {name} must be a torch.Tensor of {count}, got {type(ids).__name__}")
    if list(ids.shape) != shape:
        raise ValueError(f"{who}: {name} is {list(ids.shape)}, {lp} {list(logp.shape)}: pass one {kind} id per "
                         f"{per}, a {shape} tensor ({share})")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{who}: {name} is {ids.dtype}: pass integer {kind} ids ({name}.long())")
    if ids.device != logp.device:
        raise ValueError(f"{who}: {name} is on {ids.device}, {lp} on {logp.device}: move it with "
                         f"{name}.to({lp}.device)")


def turn_ids(kept: torch.Tensor) -> torch.Tensor:
    """[B, T] turn ids from a mask (or a host's tool mask) whose gaps inside a response are the
    environment's tokens (a tool's output, an observation): a turn ends where a run of dropped
    tokens begins after a kept one, so a token's id counts those runs before it (a host's own
    derivation: OpenRLHF's action ranges, TRL's tool_mask)."""
    k = kept != 0
    starts = torch.zeros_like(k)
    starts[:, 1:] = ~k[:, 1:] & k[:, :-1]
    return starts.long().cumsum(-1)


def refuse_bad_staleness(who: str, names: dict, staleness, mask, sync_free: bool = False) -> None:
    """Staleness counts policy versions: finite and ≥ 0 on every unmasked token (a NaN would pass
    through AReaL's interpolation weight silently); read on the CPU, an asynchronous assert on the
    sync-free path (CUDA's)."""
    if staleness is None:
        return
    name = names.get("staleness", "staleness")
    keep = torch.ones_like(staleness, dtype=torch.bool) if mask is None else mask != 0
    ok = (~keep | (torch.isfinite(staleness) & (staleness >= 0))).all()
    msg = (f"{who}: {name} {list(staleness.shape)} holds a value that is not a finite count ≥ 0 on an unmasked "
           "token{}: pass each token's number of policy versions behind the current one (0: on-policy)")
    if staleness.is_cuda or sync_free:
        torch._assert_async(ok, msg.format(""))
    elif not ok:
        bad = staleness[keep & ~(torch.isfinite(staleness) & (staleness >= 0))][0].item()
        raise ValueError(msg.format(f" ({bad!r})"))


def refuse_bad_norm(who: str, names: dict, norm, mask, logp, sync_free: bool = False) -> None:
    """Aggregation.norm, the global normalizer the loss divides by: a Python number or a 0-d real
    tensor, finite and > 0, or 0 where the step has no token (every path then gives loss 0 and
    gradient 0); a negative one would flip the loss and its update silently. Its shape is checked
    here; its value is read where that costs no host sync (a Python number, a CPU tensor; the mask on
    the CPU), else checked by an asynchronous device assert, as the mask's values are."""
    if norm is None:
        return
    name = names.get("norm", "aggregation.norm")
    fix = ("pass the step's token (or response) count over the data-parallel ranks, one number > 0 (a per-token or "
           f"per-response factor goes in Aggregation(weights=...), [batch, tokens])")
    if isinstance(norm, torch.Tensor):
        if norm.dim() != 0:
            raise ValueError(f"{who}: {name} is {list(norm.shape)}: the global normalizer is one number (0-d); {fix}")
        if norm.dtype == torch.bool or norm.is_complex():
            raise ValueError(f"{who}: {name} is {norm.dtype}: {fix}")
    elif isinstance(norm, bool) or not isinstance(norm, (int, float)):
        raise TypeError(f"{who}: {name} must be a number or a 0-d tensor, got {type(norm).__name__}: {fix}")
    msg = f"{who}: {name} is {{}}: it must be finite and > 0 (0 only where the step has no unmasked token); {fix}"
    if isinstance(norm, torch.Tensor) and norm.device.type != "cpu":
        keep = torch.ones((), dtype=torch.bool, device=norm.device) if mask is None else (mask != 0).any()
        ok = torch.isfinite(norm) & ((norm > 0) | ((norm == 0) & ~keep.to(norm.device)))
        torch._assert_async(ok, msg.format("not finite and > 0 on a step with tokens"))
        return
    value = float(norm)
    if not math.isfinite(value) or value < 0:
        raise ValueError(msg.format(repr(value)))
    if value == 0:
        if mask is None:
            if logp.numel():
                raise ValueError(msg.format("0 on a step with tokens"))
        elif mask.is_cuda or sync_free:
            torch._assert_async(~(mask != 0).any(), msg.format("0 on a step with tokens"))
        elif (mask != 0).any():
            raise ValueError(msg.format("0 on a step with tokens"))


def group_representatives(groups):
    """[batch]: for each response, the first response of its group (the row its group's sums are
    gathered at), without a host sync (no unique: a [batch, batch] comparison)."""
    index = torch.arange(groups.shape[0], device=groups.device)
    return torch.where(groups[:, None] == groups[None, :], index, groups.shape[0]).amin(-1)


def check_entropy_graph(who: str, names: dict, entropy, logp) -> None:
    """An objective that reads H trains it through its own gradient channel: an entropy cut off
    from the policy's graph (detached) while log π carries a gradient would drop that term silently."""
    if entropy is not None and torch.is_grad_enabled() and logp.requires_grad and not entropy.requires_grad:
        name = names.get("entropy", "entropy")
        raise ValueError(f"{who}: {name} {list(entropy.shape)} has no gradient while "
                         f"{names.get('log_probs', 'log_probs')} has one: the objective reads H, whose gradient "
                         f"is its own term; pass the policy's entropy attached to its graph (not {name}.detach()), "
                         "or call the loss under torch.no_grad()")


def check_support(who: str, names: dict, support: dict, logp) -> None:
    """The vocabulary support's log-probs (vocab_log_probs: the policy's, attached to its graph;
    vocab_ref_log_probs: π_ref's or the teacher's, on the same entries): floating [batch, tokens, k]
    on log_probs' device, one k for both, or a message naming the tensor, its shape and the fix."""
    lp, shape, ks = names.get("log_probs", "log_probs"), list(logp.shape), set()
    for key, x in support.items():
        if x is None:
            continue
        name = names.get(key, key)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{who}: {name} must be a torch.Tensor of shape {shape + ['k']}, got {type(x).__name__}")
        if x.dim() != 3 or list(x.shape[:2]) != shape or x.shape[2] < 1:
            raise ValueError(f"{who}: {name} is {list(x.shape)}, {lp} {shape}: pass the log-probs of each token's "
                             f"top-k support, [batch, tokens, k] with k ≥ 1")
        if x.device != logp.device:
            raise ValueError(f"{who}: {name} is on {x.device}, {lp} on {logp.device}: move it with "
                             f"{name}.to({lp}.device)")
        if not x.is_floating_point():
            raise ValueError(f"{who}: {name} is {x.dtype}: pass floating-point log-probs ({name}.float())")
        ks.add(x.shape[2])
    if len(ks) > 1:
        raise ValueError(f"{who}: {' and '.join(names.get(k, k) for k in support)} hold different supports "
                         f"(k = {sorted(ks)}): pass both on the same k entries of each token")
    policy = support.get("vocab_log_probs")
    if policy is not None and torch.is_grad_enabled() and logp.requires_grad and not policy.requires_grad:
        name = names.get("vocab_log_probs", "vocab_log_probs")
        raise ValueError(f"{who}: {name} {list(policy.shape)} has no gradient while {lp} has one: the vocabulary "
                         f"sum trains every entry of the support through it; pass the support's log-probs attached "
                         f"to the policy's graph (log_softmax(logits).gather(-1, index), not {name}.detach())")
