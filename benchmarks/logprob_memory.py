"""One policy training step with a large vocabulary: stock OpenRLHF 0.11.2's actor against
drpo-train's, on the same batch, side by side in one run. Prints JSON: each variant's peak
memory and median step time, and their ratios (drpo / openrlhf; < 1 is better).

    python3 benchmarks/logprob_memory.py [--device cpu|cuda] [--vocab 151936] [--hidden 512]
        [--layers 2] [--batch 4] [--prompt 128] [--response 384] [--chunk 512] [--entropy]
        [--repeat 5]

The model: Qwen2-shaped, random init, bf16 (OpenRLHF's --ds.param_dtype default), tied
embeddings as Qwen2-0.5B, sdpa attention. The batch: B sequences of left-padded prompts and
responses ending at different lengths, as OpenRLHF's samples come. A step is the actor's forward,
the policy loss (plus the entropy bonus with --entropy, as --actor.entropy_coef adds it) and
backward into the parameters' .grad (no optimizer step: both would take the same one).
- openrlhf: OpenRLHF's Actor.forward (logits [B, T, V] in fp32, prompt included) and its
  PolicyLoss (PPO clip);
- drpo: the same Actor with drpo-train's forward (--drpo.chunked_logprobs on: log-probs from the
  hidden states, --chunk tokens at a time, response positions only) and ObjectiveLoss('ppo').
Time: the median of --repeat interleaved steps per variant (after one warm-up each), in this
process. Peak: each variant in a fresh subprocess, over one step after a warm-up: on CPU the
growth of the resident set over the step (the kernel's high-water mark reset by clear_refs,
large tensors mmap'd so that freed memory leaves the resident set); on CUDA the growth of
torch.cuda.max_memory_allocated over the step, and the absolute peak.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not torch.cuda.is_available():   # DeepSpeed (imported by OpenRLHF) says aloud it found no CUDA otherwise
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
from openrlhf_drpo.hosts.openrlhf import cpu_mode  # noqa: E402

cpu_mode.install_flash_attn_shim()      # OpenRLHF imports flash_attn at module level

VARIANTS = ("openrlhf", "drpo")


def build(args):
    """The model (shared by both variants' Actors) and the batch, the same in every process."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), tie_word_embeddings=True,
                         max_position_embeddings=args.prompt + args.response, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).to(device=args.device, dtype=torch.bfloat16)
    B, P, R = args.batch, args.prompt, args.response
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(1, args.vocab, (B, P + R), generator=g)
    attention = torch.ones_like(sequences)
    for i in range(B):      # prompts shorter by up to a quarter, responses ending from half-way on
        attention[i, :int(torch.randint(0, P // 4 + 1, (), generator=g))] = 0
        attention[i, P + int(torch.randint(R // 2, R + 1, (), generator=g)):] = 0
    sequences[attention == 0] = 0
    action_mask = attention[:, P:].bool()
    old = -torch.rand(B, R, generator=g) * 3 - 0.05
    advantages = torch.randn(B, 1, generator=g).expand(B, R).contiguous()
    batch = [x.to(args.device) for x in (sequences, attention, action_mask, old, advantages)]
    return model, batch


def variant(name, model, args):
    """One step's function for this variant."""
    from openrlhf.models.actor import Actor
    from openrlhf.models.loss import PolicyLoss
    from openrlhf_drpo import ObjectiveLoss
    from openrlhf_drpo.hosts.openrlhf import logprobs
    actor = Actor(model, temperature=1.0)
    actor.packing_samples = False       # set by Actor's from-path branch only
    if name == "drpo":
        logprobs.install(actor, args.chunk)
    loss_fn = ObjectiveLoss("ppo") if name == "drpo" else PolicyLoss()

    def step(sequences, attention, action_mask, old, advantages):
        log_probs, output = actor(sequences, action_mask, attention_mask=attention, return_output=True,
                                  return_entropy=args.entropy)
        loss = loss_fn(log_probs, old, advantages, action_mask=action_mask)[0]
        if args.entropy:      # as ActorPPOTrainer.training_step adds it (token-mean over the actions)
            entropy = output.entropy[:, -action_mask.shape[1]:]
            loss = loss - 0.01 * (entropy * action_mask).sum() / action_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _status_bytes(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def peak_child(name, args) -> dict:
    """In a fresh process: the memory one step takes, after a warm-up step."""
    model, batch = build(args)
    step = variant(name, model, args)
    step(*batch)
    sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(*batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"step_peak_bytes": peak - base, "peak_bytes": peak}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")        # resets VmHWM to the current resident set
    base = _status_bytes("VmRSS")
    step(*batch)
    return {"step_peak_bytes": _status_bytes("VmHWM") - base}


def peak(name, args) -> dict:
    # a fixed mmap threshold: glibc would raise it after the first free, keeping large tensors in the heap
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", name], check=True,
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen2's: 151,936)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="B sequences")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (padded)")
    ap.add_argument("--response", type=int, default=384, help="response tokens per sequence (padded)")
    ap.add_argument("--chunk", type=int, default=512, help="drpo's --drpo.logprob_chunk")
    ap.add_argument("--entropy", action="store_true", help="with the entropy bonus (--actor.entropy_coef)")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(peak_child(args.child, args)))
        return
    peaks = {name: peak(name, args) for name in VARIANTS}
    model, batch = build(args)
    steps = {name: variant(name, model, args) for name in VARIANTS}
    times = {name: [] for name in VARIANTS}
    for name in VARIANTS:
        steps[name](*batch)     # warm-up (ObjectiveLoss compiles on CUDA)
    for _ in range(args.repeat):     # interleaved, so that the machine's drift hits both alike
        for name in VARIANTS:
            sync(args.device)
            t = time.perf_counter()
            steps[name](*batch)
            sync(args.device)
            times[name].append(time.perf_counter() - t)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    mib = lambda b: round(b / 2**20, 1)    # noqa: E731
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "child"},
        "tokens": args.batch * (args.prompt + args.response),
        "step_time_ms": {name: round(median[name] * 1e3, 1) for name in VARIANTS},
        "step_peak_mib": {name: mib(peaks[name]["step_peak_bytes"]) for name in VARIANTS},
        "ratios": {"step_time": round(median["drpo"] / median["openrlhf"], 3),
                   "step_peak": round(peaks["drpo"]["step_peak_bytes"] / peaks["openrlhf"]["step_peak_bytes"], 3)},
    }
    if args.device == "cuda":
        result["peak_mib"] = {name: mib(peaks[name]["peak_bytes"]) for name in VARIANTS}
        result["ratios"]["peak"] = round(peaks["drpo"]["peak_bytes"] / peaks["openrlhf"]["peak_bytes"], 3)
    result["meets_goal"] = {"step_peak_half": result["ratios"]["step_peak"] <= 0.5,
                            "step_time_1.1x": result["ratios"]["step_time"] <= 1.1}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
