"""drpo-lab's wall time on this machine, measured: prints JSON.

    python benchmarks/lab_cpu.py [--objectives 6] [--seeds 3] [--steps 40] [--preset mild]
                                 [--parallel 1] [--standalone] [--keep DIR]

Runs `drpo-lab` on the first N of the paper's objectives (plus DRPO at other deltas) in a
temporary folder. lab_s: the lab's own time for its runs (launch of the pipelines to their exit;
the task build before it is reported apart, build_s: 0 where the task's cache held it already, see
docs/lab.md); wall_s: launch to exit. With
--standalone, the same time for one run launched alone through drpo-train, as the lab did each
run before it shared one pipeline (its own Ray, vLLM engine and DeepSpeed), and that time
times the number of runs: the old lab's cost, side by side. --keep DIR keeps the lab's
output (results, curves, logs) in DIR.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
OBJECTIVES = ["surrogate", "grpo_clip_higher", "spo:eps=12.5", "dppo_binary_tv", "drpo", "drpo:delta=0.2"]   # the paper's five at its settings (drpo: δ = 12.5), and DRPO at δ = 0.2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--objectives", type=int, default=6)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--preset", default="mild")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--keep", default=None, help="keep the lab's output in this folder")
    args = p.parse_args()
    objectives = OBJECTIVES[:args.objectives]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    result = {"objectives": objectives, "seeds": args.seeds, "steps": args.steps, "preset": args.preset,
              "parallel": args.parallel, "runs": len(objectives) * args.seeds, "cpus": os.cpu_count(),
              "load_avg_1min_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as out:
        lab_out = os.path.abspath(args.keep) if args.keep else os.path.join(out, "lab")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.lab", *objectives, "--seeds", str(args.seeds),
                               "--steps", str(args.steps), "--preset", args.preset, "--parallel", str(args.parallel),
                               "--out", lab_out], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:] + "\nlab_cpu: drpo-lab failed")
        lab_s = float(re.search(r"trained \d+ runs in (\d+) s", proc.stdout).group(1))
        result.update(wall_s=round(wall, 1), lab_s=lab_s, build_s=round(wall - lab_s, 1),
                      lab_s_per_run=round(lab_s / result["runs"], 1))
        if args.standalone:
            from openrlhf_drpo.lab import driver as lab, task as labtask, toytask
            task, _ = labtask.cached()       # the lab's task: built above, or before, into the cache
            preset = lab.PRESETS[args.preset]
            flags = toytask.flags(task, os.path.join(out, "alone"), steps=args.steps, rollout_prompts=lab.ROLLOUT_PROMPTS,
                                  samples=lab.SAMPLES, lr=preset["lr"], updates=preset["updates"])
            start = time.perf_counter()
            alone = subprocess.run([sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", "--drpo.objective", "drpo",
                                    "--drpo.anchor", "rollout", "--drpo.set", "delta=0.2", *flags,
                                    "--actor.lr_scheduler", "constant"], capture_output=True, text=True, env=env)
            alone_s = time.perf_counter() - start
            if alone.returncode != 0:
                sys.exit(alone.stdout[-3000:] + alone.stderr[-3000:] + "\nlab_cpu: drpo-train failed")
            result.update(standalone_run_s=round(alone_s, 1),
                          standalone_all_runs_s=round(alone_s * result["runs"], 1),
                          speedup=round(alone_s * result["runs"] / lab_s, 2))
    result["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
