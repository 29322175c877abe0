"""The whole drpo-train pipeline on CPU, measured: prints JSON.

    python benchmarks/pipeline_cpu.py [--steps 8] [--objective drpo]

One run of the laptop task (openrlhf_drpo/lab/toytask.py) through the real command line, with
PSS sampled over the whole process tree (driver, Ray, vLLM, DeepSpeed) every 0.2 s.
- startup_s: launch until the first step's work began (first step line minus its step_total);
- per-step medians over steps 2..N of OpenRLHF's own timings: generation (vLLM), experience
  (log-probs, rewards, advantages), training (the compiled loss on DeepSpeed), weight sync;
- peak_pss_gib: the largest PSS sum seen over the tree; wall_s: launch to exit.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not __import__("torch").cuda.is_available():   # building the model imports DeepSpeed, which else
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # says aloud that it found no CUDA
from openrlhf_drpo.lab import toytask  # noqa: E402

TIMINGS = {"generation_s": "timing/generation", "experience_s": "timing/make_experience",
           "training_s": "timing/ppo_train", "weight_sync_s": "timing/broadcast", "step_s": "timing/step_total"}


def tree_pss(root: psutil.Process) -> int:
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--objective", default="drpo")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        task = toytask.build(out)
        cmd = [sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", "--drpo.objective", args.objective,
               "--drpo.anchor", "rollout", *toytask.flags(task, out, steps=args.steps)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        root, peak, first_step_at, lines = psutil.Process(proc.pid), [0], [None], []

        def sample():
            while proc.poll() is None:
                peak[0] = max(peak[0], tree_pss(root))
                time.sleep(0.2)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for line in proc.stdout:
            lines.append(line)
            if first_step_at[0] is None and "Global step 1:" in line:
                first_step_at[0] = time.perf_counter() - start
        rc = proc.wait()
        wall = time.perf_counter() - start
        sampler.join()
    steps = toytask.steps_from_log("".join(lines))
    if rc != 0 or len(steps) != args.steps:
        sys.exit("".join(lines[-60:]) + f"\npipeline_cpu: drpo-train exited {rc} after {len(steps)} steps")
    later = steps[1:] or steps
    result = {"objective": args.objective, "steps": args.steps, "cpus": os.cpu_count(),
              "wall_s": round(wall, 1), "startup_s": round(first_step_at[0] - steps[0]["timing/step_total"], 1),
              **{k: round(statistics.median(s[key] for s in later), 3) for k, key in TIMINGS.items()},
              "peak_pss_gib": round(peak[0] / 2**30, 2),
              "vllm_kl_max": max(s["vllm_kl"] for s in steps), "reward_first": steps[0]["reward"],
              "reward_last": steps[-1]["reward"]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
