"""The vocabulary sum's memory at a real head's shape (issue 38 item 4): opd_topk_tail's loss and
its gradient to the hidden states and the LM head, with the policy's log-probs on a teacher's
top-k support scored from the full [N, V] logits, and scored in chunks by drpo-train's
`support_logprobs` (hosts/openrlhf/support.py: the logits never exist whole). Prints JSON: time
and peak memory above the inputs of each, their ratio, and the gradients' difference.

    python3 benchmarks/support_memory.py [--device cuda|cpu] [--quick]

Default: Qwen2.5-0.5B's head (hidden 896, vocabulary 151,936, bf16 weights on CUDA), 4 x 1024
tokens, k = 32; --quick: toy sizes (tests run it so)."""
from __future__ import annotations

import argparse
import json

import torch

from gpu_check import full_against_chunked      # this script's folder is on sys.path
from openrlhf_drpo.core import CompiledLoss
from openrlhf_drpo.hosts.openrlhf.support import support_logprobs


def full_support(hidden, weight, ids):
    """log softmax of the whole [N, V] logits in fp32, at the support's ids."""
    return (hidden @ weight.T).float().log_softmax(-1).gather(-1, ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = args.device
    if device == "cpu":
        torch.set_num_threads(1)
    B, T, H, V, k = (2, 64, 64, 2048, 8) if args.quick else (4, 1024, 896, 151936, 32)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(B * T, H, generator=g) * 0.5).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(device, dtype)
    # a teacher's top-k at each token: k distinct ids, and its log-probs there (a distribution's)
    ids = torch.rand(B * T, V, generator=g).topk(k, -1).indices.to(device)
    teacher = (2 * torch.randn(B * T, k + 1, generator=g, dtype=torch.float64)).log_softmax(-1)[:, :k]
    teacher = teacher.view(B, T, k).to(device, torch.float32)
    mask = (torch.rand(B, T, generator=g) > 0.1).to(device)
    zeros = torch.zeros(B, T, device=device)
    loss_fn = CompiledLoss("opd_topk_tail", compile=False)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "shape": {"B": B, "T": T, "hidden": H, "vocab": V, "k": k, "dtype": str(dtype)}}
    out.update(full_against_chunked(
        lambda s: loss_fn(zeros, zeros, zeros, mask, vocab_log_probs=s.view(B, T, k), vocab_ref_log_probs=teacher)[0],
        hidden, weight, device, lambda h, w: full_support(h, w, ids),
        lambda h, w: support_logprobs(h, w, None, ids, None, 1.0)[0]))
    if out["full"]["peak_mib"]:
        out["peak_ratio"] = round(out["chunked"]["peak_mib"] / out["full"]["peak_mib"], 3)
    out["time_ratio"] = round(out["chunked"]["ms"] / out["full"]["ms"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
