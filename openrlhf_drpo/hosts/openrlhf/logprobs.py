"""Log-probs without the [B, T, V] logits: drpo-train's policy actor (issue 30, item 3).

OpenRLHF 0.11.2's Actor.forward forms the whole logits tensor (prompt included), casts it to
fp32 and takes log-softmax: at a 150k vocabulary that tensor and its gradient are most of a
training step's memory. `install` gives one Actor a forward in which, for the duration of each
call, the model's LM head scores the hidden states of the positions whose next token is an
action, `chunk` tokens at a time: the label's log-prob (and the entropy) per token, in fp32 as
OpenRLHF computes them. The backward recomputes each chunk's logits.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

CHUNK = 512     # tokens per chunk: at V = 152k, 300 MiB of fp32 logits


def head_logits(hidden, weight, bias, temperature):
    """One chunk's logits exactly as Actor.forward forms them: the head in the model's dtype,
    then fp32, then divided by the temperature."""
    z = F.linear(hidden, weight, bias).float()
    return z if temperature == 1.0 else z.div_(temperature)


class ChunkedLogProbs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, labels [N]) -> fp32 log p(label) [N],
    entropy [N] and Σ_v p_v² [N] (each of the last two empty unless asked for; Σ_v p_v² without
    gradient), never holding more than `chunk` rows of logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk, with_entropy, with_sum_sq=False):
        logp, lse = (hidden.new_empty(labels.shape, dtype=torch.float32) for _ in range(2))
        ent = hidden.new_empty(labels.shape if with_entropy else (0,), dtype=torch.float32)
        sq = hidden.new_empty(labels.shape if with_sum_sq else (0,), dtype=torch.float32)
        for s in range(0, len(labels), chunk):
            z = head_logits(hidden[s:s + chunk], weight, bias, temperature)
            lse[s:s + chunk] = torch.logsumexp(z, -1)
            logp[s:s + chunk] = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            if with_entropy:        # as openrlhf.models.utils.compute_entropy
                ent[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, -1) * z).sum(-1)
            if with_sum_sq:         # exp(logsumexp(2z) - 2 logsumexp(z)), as verl's sum_pi_squared
                sq[s:s + chunk] = torch.exp(torch.logsumexp(2 * z, -1) - 2 * lse[s:s + chunk])
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)     # an output the loss does not use has no gradient to compute
        ctx.mark_non_differentiable(sq)
        return logp, ent, sq

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_sq):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        grads = head_grads(ctx, hidden, weight, bias)
        for s in range(0, len(labels), ctx.chunk):
            h, rows = hidden[s:s + ctx.chunk], slice(s, s + ctx.chunk)
            log_q = head_logits(h, weight, bias, ctx.temperature).sub_(lse[rows, None])    # log-softmax
            q = log_q.exp()
            # d log q_y/dz = onehot(y) - q;  d entropy/dz = -q * (log q + entropy)
            if g_logp is None:
                dz = torch.zeros_like(q)
            else:
                dz = q * -g_logp[rows, None]
                dz.scatter_add_(-1, labels[rows, None], g_logp[rows, None])
            if g_ent is not None:
                dz -= q.mul_(log_q.add_(ent[rows, None])).mul_(g_ent[rows, None])
            del q, log_q
            add_head_grads(grads, dz, h, rows, weight, ctx.temperature)
        return (*head_grads_out(grads, weight, bias), None, None, None, None, None)


def head_grads(ctx, hidden, weight, bias) -> tuple:
    """A chunked head's backward buffers, where autograd asks for them: the hidden states' (one
    chunk's rows at a time), and the weight's and the bias's, which sum over every chunk: in fp32,
    cast once at the end (head_grads_out)."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return (torch.empty_like(hidden) if need_h else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None)


def add_head_grads(grads, dz, h, rows, weight, temperature) -> None:
    """One chunk's logits gradient dz (fp32) into the head's buffers: through the temperature and
    the fp32 cast, back into the head's dtype, as autograd does."""
    grad_h, grad_w, grad_b = grads
    dz = (dz / temperature if temperature != 1.0 else dz).to(weight.dtype)
    if grad_h is not None:
        grad_h[rows] = dz @ weight
    if grad_w is not None:
        grad_w += dz.T @ h
    if grad_b is not None:
        grad_b += dz.sum(0)


def head_grads_out(grads, weight, bias) -> tuple:
    grad_h, grad_w, grad_b = grads
    return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype))


def token_logprobs(hidden, weight, bias, labels, temperature=1.0, chunk=CHUNK, entropy=False, sum_sq=False):
    """hidden [..., H] and labels [...] -> (log p(label), entropy or None), each [...] in fp32;
    with sum_sq, a third: Σ_v p_v² (no gradient)."""
    shape = labels.shape
    logp, ent, sq = ChunkedLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1),
                                          float(temperature), int(chunk), bool(entropy), bool(sum_sq))
    out = logp.view(shape), (ent.view(shape) if entropy else None)
    return (*out, sq.view(shape)) if sum_sq else out


def unsupported(actor) -> str | None:
    """Why this Actor keeps OpenRLHF's path, or None. Packing and ring attention (flash-attn
    only) and vision-language inputs take other routes through Actor.forward that no CPU run
    can exercise; a head other than a plain Linear (LoRA on it, a quantized layer) is not a
    weight this module can multiply by."""
    if getattr(actor, "packing_samples", False):
        return "--ds.packing_samples"
    if getattr(actor, "is_vlm", False):
        return "a vision-language model"
    model = getattr(actor.model, "module", actor.model)        # inside DeepSpeed's engine
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"the model's LM head is {type(head).__module__}.{type(head).__qualname__}, not torch.nn.Linear"
    return None


def install(actor, chunk: int = CHUNK) -> str:
    """Give this OpenRLHF Actor the chunked forward where it can take it; returns the one line
    saying which path its log-probs take."""
    why = unsupported(actor)
    if why is not None:
        return f"openrlhf-drpo: log-probs from OpenRLHF's full logits: {why} (--drpo.chunked_logprobs on)"
    actor.drpo_chunk = chunk
    actor.forward = types.MethodType(forward, actor)
    return f"openrlhf-drpo: log-probs from the hidden states, {chunk} tokens at a time (--drpo.chunked_logprobs on)"


def forward(actor, sequences, action_mask=None, attention_mask=None, return_output=False, return_logprobs=False,
            return_entropy=False, drpo_sum_pi_sq=False, drpo_extra=None, **others):
    """Actor.forward (OpenRLHF 0.11.2), its unpacked text-only path, with the log-probs (and
    entropy) of the positions it returns scored in chunks. `output.entropy` covers those
    positions: [B, A] where OpenRLHF's is [B, T-1], of which ActorPPOTrainer reads the last A;
    drpo_sum_pi_sq: `output.sum_pi_sq` too, [B, A], no gradient (drpo-train's inputs.supplied).
    drpo_extra(hidden [B, A, H], head) -> [B, A, j] fp32: more scores of those positions from the
    same hidden states (the vocabulary support, support.py), in `output.drpo_extra`; they travel in
    the head's output, so that ZeRO-3's hooks on the head see their backward too. Asked for logits,
    or for a route it does not take, it is OpenRLHF's forward (refused where drpo_extra is asked)."""
    def openrlhf():
        if drpo_extra is not None:
            raise RuntimeError("openrlhf-drpo: the vocabulary support is scored from the hidden states by the chunked "
                               f"forward, which this call does not take ({unsupported(actor) or 'see above'}): its "
                               "top-k needs --drpo.chunked_logprobs on, unpacked text-only samples and a plain "
                               "torch.nn.Linear LM head whose output the model returns untouched")
        return type(actor).forward(actor, sequences, action_mask, attention_mask, return_output=return_output,
                                   return_logprobs=return_logprobs, return_entropy=return_entropy, **others)
    if getattr(actor, "drpo_chunk", None) is None or (action_mask is None and not return_logprobs) \
            or others.get("ring_attn_group") is not None \
            or set(others) - {"allgather_logits", "ring_attn_group", "packed_seq_lens"}:
        return openrlhf()
    seqlen = sequences.shape[1]
    n = seqlen - 1 if action_mask is None else min(action_mask.shape[1], seqlen - 1)
    # position t predicts token t + 1: the last n predictions, from the positions before the last
    labels = sequences[:, -n:]
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    model = getattr(actor.model, "module", actor.model)
    head = model.get_output_embeddings()
    scored, scored_sq = [], []

    def score(hidden):      # the head's forward for this call: inside the model's, as DeepSpeed expects
        logp, ent, *sq = token_logprobs(hidden[:, -n - 1:-1], head.weight, head.bias, labels, actor.temperature,
                                        actor.drpo_chunk, return_entropy, drpo_sum_pi_sq)
        scored_sq.extend(sq)        # beside the head's output: it has no gradient to travel with
        scores = torch.stack([logp, ent], -1) if return_entropy else logp[..., None]
        if drpo_extra is not None:
            scores = torch.cat([scores, drpo_extra(hidden[:, -n - 1:-1], head)], -1)
        scored.append((scores, scores._version))
        return scores
    own = head.__dict__.get("forward")
    head.forward = score
    try:
        output = actor.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    # What the model returns must be the head's output untouched: ZeRO-3 hands back a detached alias
    # (its backward hook gathers the head's weight, so that alias is what training must use), while
    # a soft cap or a scale makes new values, or changes these in place (the version counter).
    returned = output["logits"]
    if not scored or returned.data_ptr() != scored[-1][0].data_ptr() or returned.shape != scored[-1][0].shape \
            or returned._version != scored[-1][1]:
        print(f"openrlhf-drpo: {type(model).__name__} transforms its LM head's output; log-probs from OpenRLHF's "
              "full logits from now on", flush=True)
        actor.drpo_chunk = None
        return openrlhf()
    output = type(output)(**{k: v for k, v in output.items() if k != "logits"})     # no logits were formed
    log_probs = returned[..., 0]
    if return_entropy:
        setattr(output, "entropy", returned[..., 1])
    if drpo_extra is not None:
        setattr(output, "drpo_extra", returned[..., 1 + return_entropy:])
    if scored_sq:
        setattr(output, "sum_pi_sq", scored_sq[-1])
    if action_mask is not None:
        log_probs = log_probs * action_mask.float()
    return (log_probs, output) if return_output else log_probs
