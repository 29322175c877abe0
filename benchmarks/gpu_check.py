"""One-shot GPU check (issue 30): everything the compiled loss claims on a CUDA device, in one
run of at most --budget seconds (300 by default: what does not fit is skipped, saying so), printed
as JSON. Needs torch, numpy, sympy and lark only (TRL where installed).

- exactness: every shipped objective on the device (given the third version's inputs it reads: log π_ref,
  H, Σ_v π_v², groups of two), plain and fused (the sync-free kernels,
  uncompiled) in fp32, fused with bf16 log-probs, and compiled (--compiled objectives) in fp32 and
  bf16, against CompiledLoss(fused=False) in float64 on the CPU for the same inputs (log-ratios of
  +40, -30 and +25.5, r exactly 1, A = 0, an empty response): the gradient's error relative to the
  largest float64 gradient, the loss's to the float64 aggregate of |ℓ|, the metrics' relative
  error, every non-finite value; with the tolerances of tests/test_numerics.py.
- compile: dynamo's graphs per compiled objective over three sequence lengths, fp32 and bf16
  (expected: 4, a forward and a backward graph per dtype), and the seconds it took.
- syncs: forward + backward of each path (compiled, fused uncompiled, plain) under
  torch.cuda.set_sync_debug_mode("error"), with a bool and a float mask and a global normalizer:
  any synchronizing CUDA call is named (CUDA only; tests/test_core.py records host reads on CPU).
- speed: ppo and drpo, fp32 and bf16 log-probs, forward + backward at 1M and 16M tokens (T =
  4096): hand-written eager, hand-written torch.compile'd (benchmarks/loss_speed.hand_written)
  and ours compiled, metrics included; median of 10 (CUDA events), peak memory above the inputs
  (torch.cuda.max_memory_allocated), ours / hand compiled, and the fraction of the device's copy
  bandwidth (a clone of 1 GiB, read + write) that ours moves its minimal bytes at (read log π, μ,
  A and the mask once, write the gradient once).
- step_0p5b: one step at Qwen2.5-0.5B's shape (hidden 896, vocabulary 151936, bf16 weights, fp32
  logits), 4 x 1024 tokens: log-probs from the full logits and chunked (this script's own
  chunked_log_probs, or --chunked MODULE:FUNCTION, a function (hidden [N, H], weight [V, H],
  targets [N]) -> fp32 log-probs [N], e.g. the chunked log-prob Function of the OpenRLHF host
  once it lands), then drpo: loss and gradients of both, their differences, time and peak memory.
- trl (where TRL is installed): TRL's GRPOTrainer._compute_loss (dapo) against
  ObjectiveGRPOTrainer._compute_loss (grpo_clip_higher) on the device, three steps.

    python3 benchmarks/gpu_check.py [--device cuda|cpu] [--quick] [--budget 300] [--backend inductor]
        [--compiled ppo,drpo,spo,gspo,dppo_binary_tv,sapo_erf] [--chunked MODULE:FUNCTION|host]

--device cpu --quick runs every part at toy sizes (what tests/test_gpu_check.py does, with
--backend eager: dynamo without inductor's code generation), on one thread, timed in its CPU time."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import time

import torch

import dsl
import loss_speed     # this script's folder is on sys.path
from openrlhf_drpo.core import Aggregation, CompiledLoss
from openrlhf_drpo.core import loss as core_loss
from openrlhf_drpo.core.kernels import aggregation_coef

GRAD_TOL = {"fp32": 1e-5, "bf16": 2 ** -8 + 1e-5}      # tests/test_numerics.py's
HAND_COMPILE: dict = {}         # torch.compile's options for the hand-written losses (--backend)
LOSS_TOL = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def edge_batch(B=8, T=64, seed=0):
    """The numerics' edges (tests/test_numerics.py takes them from here): log-ratios +40, -30, +25.5 and 0, a
    response at r = 1, A = 0, an empty response; values exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    new = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[0] = False
    old[1, :4] = torch.tensor([-40.5, -0.5, -26.0, -1.25], dtype=torch.float64)
    new[1, :4] = torch.tensor([-0.5, -30.5, -0.5, -1.25], dtype=torch.float64)
    mask[1, :4] = True
    new[2] = old[2]
    A[3, ::2] = 0.0
    return new, old, A, mask, old - 0.1 * A.abs() - 0.05


def third_inputs(new, seed=0):
    """The third and fourth versions' inputs for a batch of log-probs `new` (tests/extra_inputs.py's):
    log π_ref near log π, H in [0, 2), Σ_v π_v² between π² and π² + (1 − π)², two responses per
    group, turns of three tokens, staleness 0 to 3."""
    g = torch.Generator().manual_seed(seed)
    noise = lambda: torch.rand(new.shape, generator=g, dtype=torch.float64)      # noqa: E731
    pi = torch.exp(new.double())
    return {"ref_log_probs": new.double() + 0.4 * (noise() - 0.5), "entropy": 2 * noise(),
            "sum_pi_sq": pi ** 2 + noise() * (1 - pi) ** 2, "groups": torch.arange(new.shape[0]) // 2,
            "turns": (torch.arange(new.shape[-1]) // 3).expand(new.shape),
            "staleness": torch.randint(0, 4, new.shape, generator=g).double(),
            # a top-3 support: 3 entries of a distribution over 5 (the vocabulary sums')
            **{k: (2 * torch.randn((*new.shape, 5), generator=g, dtype=torch.float64)).log_softmax(-1)[..., :3]
               for k in ("vocab_log_probs", "vocab_ref_log_probs")}}


def run(loss_fn, new, old, A, mask, rollout, extras=None):
    """(loss, ∂loss/∂log π, metrics); `extras`: the third version's inputs, of which the objective
    gets those it reads. A vocabulary sum's gradient is the support's too: ∂loss/∂log π and
    ∂loss/∂(the support's log π), flattened one after the other."""
    lp = new.clone().requires_grad_()
    given = {k: v for k, v in (extras or {}).items() if k in loss_fn.inputs()}
    for key in ("entropy", "vocab_log_probs"):      # the policy's, with a gradient of their own (a detached one is refused)
        if key in given:
            given[key] = given[key].clone().requires_grad_()
    loss, metrics = loss_fn(lp, old, A, mask, rollout_log_probs=rollout, **given)
    wrt = [lp] + ([given["vocab_log_probs"]] if "vocab_log_probs" in given else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grad = torch.cat([(torch.zeros_like(x) if g is None else g).flatten() for x, g in zip(wrt, grads)])
    return loss.detach(), grad, metrics.values


def compare(name, dtype, device, loss_fn, batch):
    """Errors of loss_fn on `device` against the float64 plain path on the CPU, same inputs."""
    new, old, A, mask, rollout = batch
    low = [new.to(DTYPES[dtype]), old.to(DTYPES[dtype]), A.float(), rollout.to(DTYPES[dtype])]
    ref_in = [x.double() for x in low]
    # the third version's inputs in the low precision too, so that the reference reads the same values
    low_x = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in third_inputs(new).items()}
    ref_x = {k: v.double() if v.is_floating_point() else v for k, v in low_x.items()}
    reference = CompiledLoss(name, fused=False)
    ref_loss, ref_grad, ref_metrics = run(reference, *ref_in[:3], mask, ref_in[3], ref_x)
    loss, grad, metrics = (x.cpu() for x in run(loss_fn, *(x.to(device) for x in low[:3]), mask.to(device),
                                                   low[3].to(device), {k: v.to(device) for k, v in low_x.items()}))
    # the generated code's TokenBatch as CompiledLoss builds it, μ the objective's anchor (π_old put in
    # for π_rollout scaled seq_mis's fp32 loss error by another objective's size: 6e-4, not 1e-6)
    b = reference.batch(ref_in[0], ref_in[1], ref_in[2], mask, rollout_log_probs=ref_in[3], **ref_x)
    per_token = reference.generated.value(b, mask)
    coef, count = aggregation_coef(mask.double(), reference.aggregate)
    magnitude = (torch.where(mask, per_token.abs(), 0.0) * coef).sum().item() / max(count.sum().item(), 1)
    values = torch.cat([loss.reshape(1).float(), grad.float().flatten(), metrics.float()])
    error, largest = (grad.double() - ref_grad).abs().max().item(), ref_grad.abs().max().item()
    # below the dtype's smallest normal number (VESPO's gradient reaches 4.7e-39 here) a value
    # has fewer bits than the dtype: such an error is held to that number, not to the largest.
    # A tail 1 − Q of a top-k support (Q = Σ_k π_v) is rounded in the dtype to ε·Q/(1 − Q) of itself,
    # and its gradient with it: that much more is the objective's conditioning, not the kernels'
    cond = max([0.0] + [(lambda q: (q / (1 - q))[mask].max().item())(v.double().exp().sum(-1))
                        for k, v in ref_x.items() if k.startswith("vocab") and k in reference.inputs()])
    tol = GRAD_TOL[dtype] + torch.finfo(torch.float32).eps * cond     # (bf16 inputs are computed in fp32)
    return {"grad": error / largest, "grad_ok": error <= tol * largest + torch.finfo(grad.dtype).tiny, "cond": cond,
            "loss": abs(loss.item() - ref_loss.item()) / max(magnitude, 1e-300),
            "loss_ok": abs(loss.item() - ref_loss.item()) <= LOSS_TOL * magnitude + torch.finfo(loss.dtype).tiny,
            "metrics": ((metrics.double() - ref_metrics).abs() / ref_metrics.abs().clamp(min=1e-6)).max().item(),
            "non_finite": int((~torch.isfinite(values)).sum())}


def summarize(errors: dict) -> dict:
    """The worst of each error over objectives, which objective, and whether the tolerances hold
    (the metrics' errors are reported, not held: a count of tokens whose gradient is 0 moves where
    fp32 flushes a tiny gradient to 0)."""
    out = {}
    for key in ("grad", "loss", "metrics"):
        name = max(errors, key=lambda n: errors[n][key])
        out[key] = {"max": errors[name][key], "objective": name}
    out["non_finite"] = sum(e["non_finite"] for e in errors.values())
    out["within"] = all(e["grad_ok"] and e["loss_ok"] for e in errors.values()) and out["non_finite"] == 0
    return out


def exactness(device, compiled, deadline):
    batch = edge_batch()
    errors = {"plain fp32": {}, "fused fp32": {}, "fused bf16": {}, "compiled fp32": {}, "compiled bf16": {}}
    for name in dsl.shipped_names():
        if time.monotonic() > deadline:
            return {"skipped": f"out of time after {len(errors['plain fp32'])} objectives"}
        errors["plain fp32"][name] = compare(name, "fp32", device, CompiledLoss(name, fused=False, compile=False),
                                             batch)
        for dtype in ("fp32", "bf16"):
            errors[f"fused {dtype}"][name] = compare(name, dtype, device, CompiledLoss(name, compile=False), batch)
    for name, loss_fn in compiled.items():
        for dtype in ("fp32", "bf16"):
            errors[f"compiled {dtype}"][name] = compare(name, dtype, device, loss_fn, batch)
    return {path: summarize(e) | {"objectives": len(e)} for path, e in errors.items() if e}


def compile_counts(device, names, deadline):
    """Each objective compiled (one CompiledLoss kept for the later parts), and its graphs."""
    from torch._dynamo.utils import counters
    out, kept = {}, {}
    for name in names:
        if time.monotonic() > deadline:
            out[name] = {"skipped": "out of time"}
            continue
        counters.clear()
        start, loss_fn = time.monotonic(), CompiledLoss(name, compile=True)
        for dtype in DTYPES.values():
            for T in (64, 96, 160):
                new, old, A, mask, rollout = (x.to(device) for x in edge_batch(T=T, seed=T))
                run(loss_fn, new.to(dtype), old.to(dtype), A.float(), mask, rollout.to(dtype))
        out[name] = {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
                     "seconds": round(time.monotonic() - start, 2)}
        kept[name] = loss_fn
    return out, kept


# the four first checked, and one of each reduction since (order statistics, turns, the vocabulary,
# the prefix, staleness, per-response quantiles)
SYNCS = "ppo,drpo,gspo,icepop,top_entropy,passk_max,gspo_turn,opd_topk_tail,otb,areal_prox,cppo,mu_grpo"


def syncs(device, compiled, deadline, names=SYNCS):
    if device != "cuda":
        return {"skipped": "CUDA only (tests/test_core.py records host reads on the CPU)"}
    out = {}
    for name in names.split(","):
        if time.monotonic() > deadline:
            out[name] = "skipped: out of time"
            continue
        paths = {"fused uncompiled": CompiledLoss(name, compile=False),
                 "plain": CompiledLoss(name, fused=False, compile=False)}
        if name in compiled:        # (compiled here only if compiled above: a compile costs seconds)
            paths["compiled"] = compiled[name]
        new, old, A, mask, rollout = (x.to(device) for x in edge_batch())
        extras = {k: v.to(device=device, dtype=torch.float32) if v.is_floating_point() else v.to(device)
                  for k, v in third_inputs(new.cpu()).items() if k in paths["plain"].inputs()}
        for path, loss_fn in paths.items():
            for mask_kind, m in (("bool mask", mask), ("float mask", mask.float())):
                def step():
                    lp = new.float().requires_grad_()
                    given = {k: v.clone().requires_grad_() if k in ("entropy", "vocab_log_probs") else v
                             for k, v in extras.items()}
                    loss, metrics = loss_fn(lp, old.float(), A.float(), m, rollout_log_probs=rollout.float(),
                                            aggregation=Aggregation(norm=100.0), **given)
                    loss.backward()
                step()              # compiles, outside the watch
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                    seen = None
                except RuntimeError as e:
                    seen = str(e).splitlines()[0]
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                out[f"{name} {path}, {mask_kind}"] = seen or "no sync"
    return {"any_sync": any(v not in ("no sync", "skipped: out of time") for v in out.values()), "paths": out}


def timed(fn, device, reps=10):
    """Median milliseconds of fn() and its peak memory above what was allocated before (MiB)."""
    fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    for _ in range(reps):     # one thread's CPU time (main sets one): other jobs on the machine do not move it
        t = time.thread_time()
        fn()
        times.append((time.thread_time() - t) * 1e3)
    return statistics.median(times), None     # CPU peaks: benchmarks/loss_speed.py (RSS, a process each)


def copy_bandwidth(device, nbytes):
    x = torch.empty(nbytes // 4, device=device)
    ms, _ = timed(lambda: x.clone(), device)
    return 2 * nbytes / (ms / 1e3)        # read + write, bytes/s


def speed(device, sizes, compiled, deadline):
    T = 4096 if device == "cuda" else 1024
    bandwidth = copy_bandwidth(device, 2 ** 30 if device == "cuda" else 2 ** 26)
    out = {"T": T, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "runs": {}}
    for name in ("ppo", "drpo"):
        ours = compiled.get(name) or CompiledLoss(name, compile=True)
        fns = {"hand eager": loss_speed.hand_written(name), "hand compiled": torch.compile(loss_speed.hand_written(name), **HAND_COMPILE),
               "ours compiled": lambda lp, old, A, mask, f=ours: f(lp, old, A, mask)[0]}
        for dtype in DTYPES:
            for size in sizes:
                key = f"{name} {dtype} {size}"
                if time.monotonic() > deadline:
                    out["runs"][key] = {"skipped": "out of time"}
                    continue
                tokens = loss_speed.parse_tokens(size)
                new, old, A, mask = loss_speed.inputs(tokens // T, T, device, DTYPES[dtype])
                row = {}
                for variant, fn in fns.items():
                    ms, mib = timed(lambda fn=fn: loss_speed.step(fn, new, old, A, mask), device)
                    row[variant] = {"ms": round(ms, 3), "peak_mib": None if mib is None else round(mib, 1)}
                hc, ours_row = row["hand compiled"], row["ours compiled"]
                row["ours / hand compiled"] = {
                    "time": round(ours_row["ms"] / hc["ms"], 3),
                    "peak": None if hc["peak_mib"] in (None, 0) else round(ours_row["peak_mib"] / hc["peak_mib"], 3)}
                minimal = tokens * (2 * new.element_size() + A.element_size() + mask.element_size()
                                    + new.element_size())
                row["ours fraction of copy bandwidth"] = round(minimal / (ours_row["ms"] / 1e3) / bandwidth, 3)
                out["runs"][key] = row
    return out


def full_log_probs(hidden, weight, targets):
    logits = (hidden @ weight.T).float()
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weightᵀ)[target], a chunk of tokens at a time, in fp32: the [N, V]
    logits never exist at once; backward recomputes each chunk's."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        out = torch.empty(hidden.shape[0], device=hidden.device)
        for i in range(0, hidden.shape[0], chunk):
            out[i:i + chunk] = full_log_probs(hidden[i:i + chunk], weight, targets[i:i + chunk])
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets = ctx.saved_tensors
        grad_h, grad_w = torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[i:i + ctx.chunk], targets[i:i + ctx.chunk]
            d = -(h @ weight.T).float().softmax(-1)          # d log p[t] / d logits = onehot(t) - softmax
            d[torch.arange(len(t), device=d.device), t] += 1
            d *= g[i:i + ctx.chunk, None]
            grad_h[i:i + ctx.chunk] = (d @ weight.float()).to(hidden.dtype)
            grad_w += d.T @ h.float()
        return grad_h, grad_w.to(weight.dtype), None, None


def chunked_log_probs(hidden, weight, targets, chunk=1024):
    return ChunkedLogProbs.apply(hidden, weight, targets, chunk)


def host_chunked_log_probs(hidden, weight, targets):
    """drpo-train's own chunked log-probs (--drpo.chunked_logprobs), with no bias: `--chunked host`."""
    from openrlhf_drpo.hosts.openrlhf.logprobs import token_logprobs
    return token_logprobs(hidden, weight, None, targets)[0]


def full_against_chunked(loss_of, hidden, weight, device, full, chunked) -> dict:
    """Scoring from the hidden states and the LM head's weight the full way (the [N, V] logits) and
    the chunked way, each fn(h, w), then loss_of(scored) and its backward: each way's time and peak
    memory (timed), and the chunked way's loss and gradients against the full way's."""
    out, results = {}, {}
    for kind, fn in (("full", full), ("chunked", chunked)):
        def step(fn=fn):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss = loss_of(fn(h, w))
            loss.backward()
            return loss.detach(), h.grad, w.grad
        results[kind] = step()
        ms, mib = timed(step, device, reps=3)
        out[kind] = {"ms": round(ms, 2), "peak_mib": None if mib is None else round(mib, 1)}
    (l0, h0, w0), (l1, h1, w1) = results["full"], results["chunked"]
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()   # noqa: E731
    out["difference"] = {"loss": abs(l1.item() - l0.item()), "grad_hidden": rel(h1, h0), "grad_weight": rel(w1, w0)}
    return out


def step_0p5b(device, quick, chunked_spec, compiled):
    if chunked_spec == "host":
        chunked = host_chunked_log_probs
    elif chunked_spec:
        module, _, attr = chunked_spec.partition(":")
        try:
            chunked = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            return {"skipped": f"--chunked {chunked_spec}: {type(e).__name__}: {e}"}
    else:
        chunked = chunked_log_probs
    B, T, H, V = (2, 64, 64, 2048) if quick else (4, 1024, 896, 151936)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(B * T, H, generator=g) * 0.5).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(device, dtype)
    targets = torch.randint(V, (B * T,), generator=g).to(device)
    A = torch.randn(B, T, generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.1).to(device)
    loss_fn = compiled.get("drpo") or CompiledLoss("drpo", compile=device == "cuda")
    old = full_log_probs(hidden, weight, targets).view(B, T).detach() + 0.05
    out = {"shape": {"B": B, "T": T, "hidden": H, "vocab": V, "dtype": str(dtype)}, "log_probs": chunked.__module__ + "."
           + chunked.__name__}
    out.update(full_against_chunked(lambda lp: loss_fn(lp.view(B, T), old, A, mask)[0], hidden, weight, device,
                                    lambda h, w: full_log_probs(h, w, targets), lambda h, w: chunked(h, w, targets)))
    if dtype == torch.bfloat16:
        out["note"] = ("the full path's backward rounds d(log p)/d(logits) to bf16, the logits' dtype, before the "
                       "matmuls; the chunked one keeps it in fp32: gradients differ at bf16's precision")
    return out


def trl_check(device):
    if importlib.util.find_spec("trl") is None:
        return {"skipped": "trl is not installed"}
    from trl import GRPOTrainer
    import host_loss_speed
    from openrlhf_drpo.trl import ObjectiveGRPOTrainer
    steps = []
    for seed in range(3):
        theirs, ours, inputs = host_loss_speed.trl_harnesses(4, 256, device, seed)
        losses, grads = [], []
        for cls, h in ((GRPOTrainer, theirs), (ObjectiveGRPOTrainer, ours)):
            loss = cls._compute_loss(h, None, inputs)
            loss.backward()
            losses.append(loss.item())
            grads.append(h.lp.grad)
        steps.append({"trl": losses[0], "ours": losses[1], "loss_difference": abs(losses[0] - losses[1]),
                      "grad_difference": (grads[0] - grads[1]).abs().max().item()})
    return {"steps": steps, "equal": all(s["loss_difference"] <= 1e-6 * max(1.0, abs(s["trl"])) for s in steps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="toy sizes (32k and 64k tokens, a toy 0.5B shape)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; what does not fit is skipped")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend for ours and hand-written")
    ap.add_argument("--compiled", default="ppo,drpo,spo,gspo,dppo_binary_tv,sapo_erf")
    ap.add_argument("--syncs", default=SYNCS, help="the objectives whose paths are watched for a host sync")
    ap.add_argument("--chunked", default="", help="MODULE:FUNCTION of a chunked log-prob function to check, "
                    "or 'host': drpo-train's own (openrlhf_drpo.hosts.openrlhf.logprobs)")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget * 0.9
    if args.backend != "inductor":       # (inductor's options are for inductor)
        core_loss.COMPILE_OPTIONS = {"dynamic": True, "backend": args.backend}
        HAND_COMPILE["backend"] = args.backend
    device = args.device
    if device == "cpu":
        torch.set_num_threads(1)
    start = time.monotonic()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "cuda": torch.version.cuda, "quick": args.quick, "backend": args.backend}
    names = args.compiled.split(",")[:1] if args.quick else args.compiled.split(",")
    result["compile"], compiled = compile_counts(device, names, deadline)
    result["exactness"] = exactness(device, compiled, deadline)
    result["syncs"] = syncs(device, compiled, deadline, args.syncs)
    sizes = ["32k", "64k"] if args.quick else ["1M", "16M"]
    result["speed"] = speed(device, sizes, compiled, deadline)
    result["step_0p5b"] = (step_0p5b(device, args.quick, args.chunked, compiled) if time.monotonic() < deadline
                           else {"skipped": "out of time"})
    result["trl"] = trl_check(device) if time.monotonic() < deadline else {"skipped": "out of time"}
    result["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
