"""The cost of exact batch reductions over micro-batches (issue 39, item 1): an optimizer step of 4
micro-batches takes its batch statistics (core.collectives.BatchStatistics) in no-grad passes
before it trains; this times those passes against the step's training pass, on CPU, one thread.

    python3 benchmarks/batch_statistics.py [--reps N]      # prints JSON

"loss": the loss alone on given log-probs (B×T per micro-batch): the passes' no-grad loss calls
against the training calls' loss + backward. "model": with a small causal LM's forward for the
log-probs, as drpo-train and TRL run it (the passes' no-grad forward + loss against forward + loss
+ backward): the host's real cost, dominated by the model. Ratios are CPU time of this thread
(the extra passes over the training pass); the wall-time ratio beside it."""
from __future__ import annotations

import argparse
import json

import torch

import dsl
from loss_speed import timed     # this script's folder is on sys.path
from openrlhf_drpo.core import Aggregation, CompiledLoss

OBJECTIVES = ("trust_the_batch", "batch_mean(r)*A")
MICRO = 4


def step(loss_fn, batches, log_probs):
    """(the no-grad passes, the training pass) of one optimizer step; log_probs(batch, grad) gives
    each micro-batch's log π (a model's forward, or the given tensor)."""
    def passes():
        stats = loss_fn.batch_statistics()
        for _ in stats.recording():
            with torch.no_grad():
                for b in batches:
                    loss_fn(log_probs(b, False), b["old"], b["A"], b["mask"],
                            aggregation=Aggregation(norm=b["norm"], process_group=stats))
        return stats
    stats = passes()

    def training():
        for b in batches:
            loss, _ = loss_fn(log_probs(b, True), b["old"], b["A"], b["mask"],
                              aggregation=Aggregation(norm=b["norm"], process_group=stats))
            loss.backward()
    return passes, training


def micro_batches(B, T, seed=0, vocab=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MICRO):
        old = -torch.rand(B, T, generator=g) * 2 - 0.05
        b = {"old": old, "logp": (old + 0.3 * torch.randn(B, T, generator=g)), "A": torch.randn(B, T, generator=g),
             "mask": torch.rand(B, T, generator=g) > 0.2}
        if vocab:
            b["ids"] = torch.randint(0, vocab, (B, T + 1), generator=g)
        out.append(b)
    total = sum(int(b["mask"].sum()) for b in out)
    for b in out:
        b["norm"] = float(total)
    return out


def model_log_probs(model):
    def log_probs(b, grad):
        ids = b["ids"]
        logits = model(ids[:, :-1]).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return log_probs


def ratio(passes, training, reps):
    (p, pw), (t, tw) = timed(passes, reps), timed(training, reps)
    return {"passes_s": round(p, 5), "training_s": round(t, 5), "ratio": round(p / t, 3), "wall_ratio": round(pw / tw, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    out = {"micro_batches": MICRO, "loss_tokens": [16, 512], "model": "Llama 4 layers × 256, vocab 2048",
           "model_tokens": [4, 128]}
    for text in OBJECTIVES:
        loss_fn = CompiledLoss(dsl.load(text) if text in dsl.shipped_names() else dsl.parse(text, "b.dsl"))
        given = micro_batches(16, 512)
        tensors = lambda b, grad: b["logp"].clone().requires_grad_(grad)     # noqa: E731
        row = {"passes": loss_fn.generated.batch_depth, "loss": ratio(*step(loss_fn, given, tensors), args.reps)}
        row["model"] = ratio(*step(loss_fn, micro_batches(4, 128, vocab=2048), model_log_probs(model)),
                             max(args.reps // 2, 2))
        out[text] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
