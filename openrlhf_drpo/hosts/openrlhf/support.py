"""The policy's log-probs on each token's top-k support, from the hidden states, without the
[B, T, V] logits (the fourth version's vocabulary sums, docs/language.md): the LM head scores
`chunk` tokens at a time, as the chunked log-prob path does for the sampled token
(hosts/openrlhf/logprobs.py), and the backward recomputes each chunk's logits. The gradient is the
exact one through the softmax: for log q_i = z_i − logsumexp(z) and the loss's g_i per entry,
dz = scatter(g) − q·Σ_i g_i, whatever function of the support (and of its tail, 1 − Σ q_i) g is of.
"""
from __future__ import annotations

import torch

from openrlhf_drpo.hosts.openrlhf.logprobs import CHUNK, add_head_grads, head_grads, head_grads_out, head_logits


class ChunkedSupport(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, index [N, k] | None, k) -> fp32 log q on the
    support [N, k] and the support [N, k] (no gradient): `index` where it is given (π_ref's or a
    teacher's top-k), else the policy's own top-k of each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, k, temperature, chunk):
        n = hidden.shape[0]
        out = hidden.new_empty((n, k), dtype=torch.float32)
        support = torch.empty((n, k), dtype=torch.long, device=hidden.device) if index is None else index
        lse = hidden.new_empty((n,), dtype=torch.float32)
        for s in range(0, n, chunk):
            rows = slice(s, s + chunk)
            z = head_logits(hidden[rows], weight, bias, temperature)
            if index is None:       # the selection has no gradient: a top-k is piecewise constant in z
                support[rows] = z.topk(k, -1).indices
            lse[rows] = torch.logsumexp(z, -1)
            out[rows] = z.gather(-1, support[rows]) - lse[rows, None]
        ctx.save_for_backward(hidden, weight, bias, support, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(support)
        return out, support

    @staticmethod
    def backward(ctx, g, _):
        hidden, weight, bias, support, lse = ctx.saved_tensors
        grads = head_grads(ctx, hidden, weight, bias)
        for s in range(0, hidden.shape[0], ctx.chunk):
            rows, h = slice(s, s + ctx.chunk), hidden[s:s + ctx.chunk]
            q = head_logits(h, weight, bias, ctx.temperature).sub_(lse[rows, None]).exp_()
            dz = q.mul_(-g[rows].sum(-1, keepdim=True)).scatter_add_(-1, support[rows], g[rows].float())
            add_head_grads(grads, dz, h, rows, weight, ctx.temperature)
        return (*head_grads_out(grads, weight, bias), None, None, None, None)


def support_logprobs(hidden, weight, bias=None, index=None, k=None, temperature=1.0, chunk=CHUNK):
    """hidden [..., H] -> (log q on the support [..., k] in fp32, with its gradient; the support
    [..., k]): on `index` [..., k] (π_ref's or a teacher's top-k ids), or on the policy's own top-k."""
    shape = hidden.shape[:-1]
    k = index.shape[-1] if index is not None else int(k)
    flat = None if index is None else index.reshape(-1, k)
    out, support = ChunkedSupport.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat, k,
                                        float(temperature), int(chunk))
    return out.view(*shape, k), support.view(*shape, k)


EXACT_IDS = 1 << 24     # fp32 holds every integer below 2^24 exactly: the ids travel as fp32 (reference_topk)


def reference_topk(actor, sequences, action_mask, attention_mask, k: int):
    """π_ref's (or a teacher's) forward in drpo-train's reference actor, for an objective whose
    vocabulary sums read π_ref's top-k: [B, A, 1 + 2k] fp32, without gradient, of each response
    token's log-prob, the top-k log-probs and their ids (exact in fp32 below 2^24), so that they
    travel where OpenRLHF carries the reference log-probs [B, A] (inputs.unpack_support splits them
    at the policy actor's append). `actor` is an OpenRLHF Actor with the chunked forward
    (logprobs.install): never more than a chunk of rows of logits."""
    from openrlhf_drpo.hosts.openrlhf.logprobs import forward

    def extra(hidden, head):
        if not 0 < k <= head.weight.shape[0]:
            raise RuntimeError(f"openrlhf-drpo: --drpo.vocab_topk {k} is not a support within the reference model's "
                               f"vocabulary of {head.weight.shape[0]} entries")
        if head.weight.shape[0] > EXACT_IDS:
            raise RuntimeError(f"openrlhf-drpo: the reference model's vocabulary of {head.weight.shape[0]} entries is "
                               f"beyond the {EXACT_IDS} ids its top-k carries exactly in fp32")
        logp, ids = support_logprobs(hidden, head.weight, head.bias, None, k, actor.temperature, actor.drpo_chunk)
        return torch.cat([logp, ids.float()], -1)
    with torch.no_grad():
        log_probs, output = forward(actor, sequences, action_mask, attention_mask, return_output=True,
                                    drpo_extra=extra)
    return torch.cat([log_probs[..., None], output.drpo_extra], -1)


def policy_support(actor, ids):
    """drpo_extra for the policy actor's training forward (logprobs.forward): log π on π_ref's top-k
    `ids` [B, A, k] at each response token, with the exact gradient through the softmax."""
    def extra(hidden, head):
        if ids.shape[:2] != hidden.shape[:2]:
            raise RuntimeError(f"openrlhf-drpo: the support's ids are {list(ids.shape)} for {list(hidden.shape[:2])} "
                               "scored positions: they must be the reference model's top-k at each response token")
        outside = (ids >= head.weight.shape[0]) | (ids < 0)
        if bool(outside.any()):
            raise RuntimeError(f"openrlhf-drpo: π_ref's top-k holds the id {int(ids[outside][0])}, outside the policy's "
                               f"vocabulary of {head.weight.shape[0]}: the reference (teacher) and the policy must "
                               "share one tokenizer and vocabulary")
        return support_logprobs(hidden, head.weight, head.bias, ids, None, actor.temperature, actor.drpo_chunk)[0]
    return extra


def refuse_other_tokenizer(teacher: str, pretrain: str) -> None:
    """--drpo.teacher: π_ref's ids index the policy's vocabulary, so the teacher's tokenizer must be
    the policy's, token for token (a smaller vocabulary of other tokens would train on wrong ids)."""
    from transformers import AutoTokenizer
    vocabs = []
    for name in (teacher, pretrain):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(name, trust_remote_code=True).get_vocab())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"openrlhf-drpo: --drpo.teacher {teacher}: the tokenizer of {name} does not load ({e}), "
                               "so the teacher's and the policy's vocabularies cannot be compared") from None
    if vocabs[0] != vocabs[1]:
        differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:3]
        raise RuntimeError(f"openrlhf-drpo: --drpo.teacher {teacher}: its tokenizer is not the policy's ({pretrain}): "
                           f"{len(vocabs[0])} against {len(vocabs[1])} tokens, differing at {differ}; π_ref's top-k "
                           "ids index the policy's vocabulary, so the two must share one tokenizer")
