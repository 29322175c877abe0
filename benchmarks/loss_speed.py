"""Compiled loss vs the same objective hand-written, in eager torch and under torch.compile (and
OpenRLHF's PolicyLoss for PPO, where openrlhf is installed): forward + backward time and peak
memory at LLM batch sizes (B·T tokens, T = 4096), in fp32 and bf16, side by side in one run.
Prints JSON with ratios (ours / reference; < 1 is better), one entry per dtype, size and
objective. Needs torch, numpy, sympy and lark only (CompiledLoss, the host-neutral core).

Variants: hand (eager torch, autograd), hand_compiled (the same function through torch.compile,
default options), policyloss (OpenRLHF's, PPO only, where installed), plain
(CompiledLoss(fused=False): the generated expression under autograd), fused_eager (the fused
kernel, not compiled: on the CPU the eager kernel CPU training uses by default; on CUDA the
sync-free kernels uncompiled) and fused (CompiledLoss(compile=True): the sync-free kernels
through torch.compile, the default on CUDA; compiled once per objective and dtype, for every
size: dynamic shapes).
Targets, judged on `fused`: issue 30, within 1.1x the time and 1.5x the peak memory of
hand_compiled, metrics included; issue 4, within 1.0x of hand-written and of PolicyLoss, and
>= 1.5x faster (time ratio <= 0.667) and <= 0.5x peak memory of hand-written eager; on
`fused_eager` (issue 11): at most 1.1x the time of hand-written eager, metrics included.

bf16: the log-probs (π and μ) are bf16, advantages fp32. hand and policyloss then compute
in bf16 (promoted to fp32 where they meet A); CompiledLoss's fused kernel computes in fp32
and returns a bf16 gradient. (OpenRLHF 0.11.2's actor itself casts logits to fp32, so under
OpenRLHF the log-probs reach the loss in fp32; bf16 is the case of a host that keeps them.)

Time: median over interleaved blocks of consecutive calls in this process; the number of
blocks shrinks with the size (--repeat at 256k tokens, at least 2), so each size costs
about the same. Wall time, or with --clock cpu (on the CPU) this thread's CPU time on one
thread: on a shared machine other jobs' time slices move wall time, not that. Peak memory: each variant runs in a fresh subprocess that, per dtype and
size, resets the kernel's RSS high-water mark and reports its growth over one forward +
backward (large CPU tensors are mmap'd and returned to the OS when freed, so RSS follows
live tensors); on CUDA, torch.cuda.max_memory_allocated.

Hosts (issue 18): TRL's and verl's built-in losses against the adapters on the same tensors, by
benchmarks/host_loss_speed.py (each skipped with the reason where its framework is missing), at
--hosts B,T ("none": not run), under "hosts" in the same JSON.

    python3 benchmarks/loss_speed.py [--device cpu|cuda] [--sizes 32k,128k,512k,1M]
        [--dtypes fp32,bf16] [--objectives drpo,ppo,spo,dppo_binary_tv] [--repeat 6] [--T 4096]
        [--variants hand,hand_compiled,plain,fused_eager,fused] [--clock wall|cpu] [--hosts 128,4096]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import importlib.util

import torch

from openrlhf_drpo.core import CompiledLoss


BLOCK = 4
REFERENCE_TOKENS = 256 * 1024     # --repeat counts blocks at this size
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_tokens(text):
    """'32k' -> 32768, '1M' -> 1048576, '5000' -> 5000."""
    scale = {"k": 1024, "m": 1024 ** 2}.get(text[-1].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def hand_written(name):
    """The objective as a researcher writes it in eager torch: loss = -masked_mean(ℓ)."""
    def ratio(lp, old):
        return torch.exp((lp - old).clamp(-20, 20))

    def drpo(lp, old, A, mask, delta=12.5):
        r = ratio(lp, old)
        return -(r * A - A.abs() / (2 * delta) * old.exp() * (r - 1) ** 2)

    def spo(lp, old, A, mask, eps=0.2):
        r = ratio(lp, old)
        return -(r * A - A.abs() / (2 * eps) * (r - 1) ** 2)

    def ppo(lp, old, A, mask, eps=0.2):
        r = ratio(lp, old)
        return -torch.min(r * A, r.clamp(1 - eps, 1 + eps) * A)

    def dppo_binary_tv(lp, old, A, mask, delta=0.15):
        r = ratio(lp, old)
        keep = (A * (r - 1) <= 0) | ((lp.exp() - old.exp()).abs() <= delta)
        return -(keep * r * A)

    per = {"drpo": drpo, "spo": spo, "ppo": ppo, "dppo_binary_tv": dppo_binary_tv}[name]
    return lambda lp, old, A, mask: (per(lp, old, A, mask) * mask).sum() / mask.sum()


HAS_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
VARIANTS = ["hand", "hand_compiled", "plain", "fused_eager", "fused", "policyloss"]


def make_fn(variant, name):
    if variant == "hand":
        return hand_written(name)
    if variant == "hand_compiled":
        return torch.compile(hand_written(name))
    if variant == "policyloss":       # the pinned OpenRLHF's, imported as the adapter imports it
        from openrlhf_drpo.hosts.openrlhf.loss import openrlhf_loss_module
        f = openrlhf_loss_module().PolicyLoss()
        return lambda lp, old, A, mask: f(lp, old, A, action_mask=mask)[0]
    f = CompiledLoss(name, fused=variant != "plain", compile=variant == "fused")
    return lambda lp, old, A, mask: f(lp, old, A, mask)[0]


def inputs(B, T, device, dtype=torch.float32, seed=0):
    """Log-probs in `dtype` (as the trainer's model gives them), advantages and mask in fp32."""
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(B, T, generator=g) * 3 - 0.05)
    new = old + 0.3 * torch.randn(B, T, generator=g)
    A = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    return [x.to(device) for x in (new.to(dtype), old.to(dtype), A, mask)]


def step(fn, new, old, A, mask):
    lp = new.detach().requires_grad_()
    fn(lp, old, A, mask).backward()
    return lp.grad


def timed(fn, reps):
    """Median (this thread's CPU seconds, wall seconds) of one call, after one warm-up call (the
    host-loss and batch-statistics benchmarks time with it)."""
    fn()
    cpu, wall = [], []
    for _ in range(reps):
        c, w = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_child(variant, configs, T, device):
    """Runs in a fresh process: the peak memory growth of one forward + backward, in bytes,
    for each (objective, dtype, tokens) in `configs`."""
    fns, out = {}, []
    for name, dtype, tokens in configs:
        new, old, A, mask = inputs(tokens // T, T, device, DTYPES[dtype])
        fn = fns.setdefault(name, make_fn(variant, name))
        step(fn, new, old, A, mask)            # import and compile everything first, at this shape
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(fn, new, old, A, mask)
            torch.cuda.synchronize()
            out.append(torch.cuda.max_memory_allocated() - base)
            continue
        # Reset the kernel's RSS high-water mark (clear_refs 5), so that VmHWM afterwards is the
        # peak of this forward + backward alone, not of the imports or the sizes before it.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_bytes("VmRSS")
        grad = step(fn, new, old, A, mask)
        del grad
        out.append(_status_bytes("VmHWM") - base)
    return out


def _status_bytes(key):
    import re
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def peaks(variant, configs, T, device):
    """One subprocess per variant (imports and compiles once), every configuration in it."""
    # A fixed mmap threshold keeps glibc from raising it after the first free, so every large
    # tensor stays mmap'd and its memory returns to the OS when freed.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--child", variant, json.dumps(configs), str(T), device],
                         check=True, capture_output=True, text=True, env=env).stdout
    return dict(zip(map(tuple, configs), json.loads(out.strip().splitlines()[-1])))


def variants_of(name, chosen=VARIANTS):
    return [v for v in chosen if v != "policyloss" or (name == "ppo" and HAS_OPENRLHF)]


def entry(med, mem):
    """Times, peaks, ratios to each reference and the targets, for one objective at one size."""
    e = {"time_ms": {v: round(t * 1e3, 3) for v, t in med.items()},
         "peak_mib": {v: round(m / 2**20, 2) for v, m in mem.items()}}
    ratio = lambda x, y: round(x / y, 3) if y else None     # noqa: E731  a peak below a page reads 0
    within = lambda x, bound: x is not None and x <= bound   # noqa: E731  unmeasured: not met
    e["ratios"] = {f"{v}/{ref}": {"time": ratio(med[v], med[ref]), "peak_mem": ratio(mem[v], mem[ref])}
                   for ref in ("hand", "hand_compiled", "policyloss") if ref in med
                   for v in ("plain", "fused_eager", "fused") if v in med}
    r = e["ratios"]
    targets = {}
    if "fused/hand_compiled" in r:
        targets["fused_within_1.1x_time_1.5x_peak_of_hand_compiled"] = (
            within(r["fused/hand_compiled"]["time"], 1.1) and within(r["fused/hand_compiled"]["peak_mem"], 1.5))
    if "fused/hand" in r:
        targets["within_1x"] = all(within(x["time"], 1.0) and within(x["peak_mem"], 1.0) for k, x in r.items()
                                   if k in ("fused/hand", "fused/policyloss"))
        targets["fused_1.5x_faster"] = within(r["fused/hand"]["time"], 1 / 1.5)
        targets["fused_half_memory"] = within(r["fused/hand"]["peak_mem"], 0.5)
    if "fused_eager/hand" in r:
        targets["eager_within_1.1x"] = within(r["fused_eager/hand"]["time"], 1.1)
    e["meets_targets"] = targets
    return e


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="32k,128k,512k,1M", help="B·T tokens per batch, comma-separated")
    ap.add_argument("--dtypes", default="fp32,bf16", help="dtype of the log-probs: fp32, bf16")
    ap.add_argument("--objectives", default="drpo,ppo,spo,dppo_binary_tv")
    ap.add_argument("--repeat", type=int, default=6,
                    help="interleaved blocks of 4 timed calls per variant at 256k tokens (scaled by size, >= 2)")
    ap.add_argument("--T", type=int, default=4096, help="sequence length; B = tokens / T")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or (CPU only) this thread's CPU time on one thread, which other jobs on a "
                         "shared machine do not move")
    ap.add_argument("--variants", default=",".join(VARIANTS[:-1]),
                    help=f"which of {','.join(VARIANTS)} to run (policyloss: ppo only, where openrlhf is installed; "
                         "by default where it is)")
    ap.add_argument("--hosts", default="128,4096",
                    help="B,T for TRL's and verl's built-in losses against the adapters (host_loss_speed.py), or none")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        variant, configs, T, device = args.child
        print(json.dumps(peak_child(variant, json.loads(configs), int(T), device)))
        return
    if args.clock == "cpu":
        if args.device != "cpu":
            ap.error("--clock cpu: CPU only (a GPU's time is not the host thread's)")
        torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    T, device = args.T, args.device
    names, dtypes = args.objectives.split(","), args.dtypes.split(",")
    sizes = {s: parse_tokens(s) for s in args.sizes.split(",")}
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    for s, n in sizes.items():
        if n < T or n % T:
            ap.error(f"--sizes: {s} = {n} tokens is not a multiple of T = {T}")
    chosen = args.variants.split(",")
    for v in chosen:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    if "policyloss" not in chosen and args.variants == ap.get_default("variants"):
        chosen.append("policyloss")
    hosts = None if args.hosts == "none" else args.hosts.split(",")
    if hosts is not None and (len(hosts) != 2 or not all(x.isdigit() and int(x) > 0 for x in hosts)):
        ap.error(f"--hosts: write B,T (for example 128,4096) or none, not {args.hosts!r}")
    fns = {name: {v: make_fn(v, name) for v in variants_of(name, chosen)} for name in names}
    times = {}
    for dtype in dtypes:
        for size, tokens in sizes.items():
            new, old, A, mask = inputs(tokens // T, T, device, DTYPES[dtype])
            repeat = max(2, round(args.repeat * REFERENCE_TOKENS / tokens))
            for name in names:
                ts = times[dtype, size, name] = {v: [] for v in fns[name]}
                for v, fn in fns[name].items():           # warm-up (and the one compilation)
                    step(fn, new, old, A, mask)
                # Interleaved blocks, so machine drift hits every variant alike; within a block the
                # first call (caches still holding the previous variant's tensors) is not counted.
                for _ in range(repeat):
                    for v, fn in fns[name].items():
                        for i in range(BLOCK + 1):
                            sync(device)
                            t = clock()
                            step(fn, new, old, A, mask)
                            sync(device)
                            if i:
                                ts[v].append(clock() - t)
    configs = [[name, dtype, tokens] for dtype in dtypes for tokens in sizes.values() for name in names]
    mem = {v: peaks(v, [c for c in configs if v in fns[c[0]]], T, device)
           for v in VARIANTS if any(v in fns[n] for n in names)}
    runs = {}
    for dtype in dtypes:
        for size, tokens in sizes.items():
            runs.setdefault(dtype, {})[size] = {
                "tokens": tokens, "B": tokens // T, "repeat": max(2, round(args.repeat * REFERENCE_TOKENS / tokens)),
                "objectives": {name: entry({v: statistics.median(t) for v, t in times[dtype, size, name].items()},
                                           {v: mem[v][name, dtype, tokens] for v in fns[name]})
                               for name in names}}
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "T": T, "threads": torch.get_num_threads(), "clock": args.clock, "load_average": os.getloadavg(),
              "runs": runs}
    if hosts is not None:       # last: it times on one thread (and restores the count)
        import host_loss_speed     # this script's folder is on sys.path
        result["hosts"] = host_loss_speed.measure(*map(int, hosts), reps=20)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
