"""drpo-lab: run several objectives through the real drpo-train pipeline on a synthetic task
built to stress trust regions, and compare their training stability, on a laptop.

    drpo-lab OBJECTIVE[:NAME=VALUE,...]... [--preset on-policy|mild|stress|stale|mismatch|random-reward]
             [--seeds N] [--steps N] [--updates N] [--lr LR] [--stale-k K] [--parallel N]
             [--out DIR] [-- DRPO_TRAIN_FLAGS...]

Each objective (a shipped name or a .dsl file, with optional overrides: `drpo:delta=0.2`)
runs once per seed, in CPU mode on CPU or on GPUs when present. All runs share one pipeline
(one Ray, one vLLM engine, one trainer: lab/pipe.py), or N side by side with --parallel N.
The task (lab/task.py) is built once per settings into a cache ($OPENRLHF_DRPO_CACHE, else
~/.cache/openrlhf-drpo) and reused. Writes DIR/results.json, DIR/results.md, DIR/results.html
and DIR/curves.png.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time

from openrlhf_drpo import __version__
from openrlhf_drpo.lab.plots import plot
from openrlhf_drpo.lab.results import aggregate, curves, html_page, markdown, rank_rule, summarize, summary_table

# Off-policyness. updates: each rollout (8 prompts x 4 samples) is cut into that many
# mini-batches, one optimizer step each, all measured against the same rollout policy.
# stale_k: the engine receives the trainer's weights only after every k-th step.
# engine_int4: the engine computes with 4-bit-rounded weights while the trainer keeps bf16.
# random_reward: a coin flip per sample, independent of what it says (pipe.random_reward).
PRESETS = {
    "on-policy": {"updates": 1, "lr": 2e-3,
                  "stresses": "nothing: one update per rollout, every update starts on-policy (the control)"},
    "mild": {"updates": 8, "lr": 2e-3,
             "stresses": "8 updates per rollout: the policy drifts up to 7 updates away from the rollout policy"},
    "stress": {"updates": 16, "lr": 1e-2,
               "stresses": "16 updates per rollout at 5x the learning rate: far off-policy, where unprotected "
                           "objectives collapse"},
    "stale": {"updates": 1, "lr": 1e-2, "stale_k": 4,
              "stresses": "stale rollouts: the engine's weights are refreshed only every k steps (--stale-k, "
                          "default 4), so a rollout comes from a policy up to k-1 steps old, as in asynchronous "
                          "RL (AReaL, slime); one update per rollout at 5x the learning rate"},
    "mismatch": {"updates": 1, "lr": 2e-3, "engine_int4": True,
                 "stresses": "engine/trainer mismatch: the engine samples with 4-bit weights (int4, one scale per 32, "
                             "as quantized rollout engines) while the trainer computes in bf16, so each step's first "
                             "update already sees r != 1; one update per rollout"},
    "random-reward": {"updates": 8, "lr": 1e-2, "random_reward": True,
                      "stresses": "a reward independent of the output (a seeded coin flip per sample), 8 updates "
                                  "per rollout at 5x the learning rate: an unbiased objective's expected update is 0, "
                                  "so what moves the policy's entropy is the batches' noise and the objective's bias "
                                  "(the Clip-Low test of a clip's bias)"},
}
ROLLOUT_PROMPTS, SAMPLES = 8, 4



def _label(name, params) -> str:
    return name + "".join(f" {k}={v}" for k, v in params.items())


def _slug(name, params, seed) -> str:
    base = os.path.splitext(os.path.basename(name))[0]
    return "-".join([base, *(f"{k}{v}" for k, v in params.items()), f"s{seed}"]).replace("/", "_")


def _show(text: str, step: int, last: bool = False) -> None:
    """The progress line: redrawn in place on a terminal, else printed every few steps."""
    if sys.stdout.isatty():
        sys.stdout.write("\r\033[K" + text + ("\n" if last else ""))
    elif last or step % 5 == 1:
        sys.stdout.write(text + "\n")
    sys.stdout.flush()


def plan(specs, args) -> list[dict]:
    """Every objective x seed, each with its folder, compiled-objective spec and log paths."""
    import dsl
    from openrlhf_drpo.hosts.openrlhf.train import objective_spec
    runs = []
    for name, params in specs:
        spec = objective_spec(dsl.load(name).with_overrides(params, {"anchor": "rollout"}, where="drpo-lab"))
        for seed in range(args.seeds):
            folder = os.path.abspath(os.path.join(args.out, "runs", _slug(name, params, seed)))
            runs.append({"name": name, "params": params, "seed": seed, "label": f"{_label(name, params)} seed {seed}",
                         "folder": folder, "spec": spec, "metrics": os.path.join(folder, "metrics.jsonl"),
                         "step_log": os.path.join(folder, "steps.jsonl")})
    return runs


_PROGRESS = re.compile(r"drpo-lab: run (?:(\d+) (started)|step (\d+) reward (\S+))")


def train_argv(task: dict, run: dict, args, folder: str) -> list[str]:
    """drpo-train's command line for a pipeline whose first run is `run` (the plugin adds the lab's)."""
    from openrlhf_drpo.lab import toytask
    flags = toytask.flags(task, folder, steps=args.steps, rollout_prompts=ROLLOUT_PROMPTS, samples=SAMPLES,
                          seed=run["seed"], lr=args.lr, updates=args.updates)
    # entropy_coef 0: OpenRLHF computes and logs the policy's entropy (entropy_loss), and adds no bonus
    return ["--drpo.objective", run["name"], "--drpo.anchor", "rollout",
            *[a for k, v in run["params"].items() for a in ("--drpo.set", f"{k}={v}")], *flags,
            "--actor.lr_scheduler", "constant", "--actor.entropy_coef", "0", *args.extra]


def refuse_untrainable(runs: list[dict], args) -> None:
    """Each objective checked as drpo-train will check it, with the lab's own flags, before the
    task is built and Ray starts: one the pipeline cannot train (π_ref, say) stops in seconds.
    The task's paths are where it will be built; nothing reads them here."""
    from openrlhf_drpo.hosts.openrlhf.train import check_objective
    task = os.path.join(args.out, "task")
    where = {"model": os.path.join(task, "model"), "prompts": os.path.join(task, "prompts.jsonl"), "reward": "reward.py"}
    said = []       # each check prints drpo-train's status lines ("CPU mode ..."): each line once
    try:
        for run in {r["label"].rsplit(" seed ", 1)[0]: r for r in runs}.values():
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    check_objective(train_argv(where, run, args, os.path.join(args.out, "pipelines", "p0")))
                finally:
                    said += [line for line in out.getvalue().splitlines() if line not in said]
    except SystemExit as e:      # argparse's own exit (its message is printed) keeps its status
        if not isinstance(e.code, str):
            raise
        raise SystemExit(e.code.replace("drpo-train: error:", "drpo-lab: error: drpo-train refuses it:", 1)) from None
    finally:
        if said:
            print(*said, sep="\n", flush=True)


def run_pipeline(task, runs: list[dict], args, folder: str, progress, env=None) -> None:
    """One drpo-train process (one Ray, vLLM engine and trainer) that trains `runs` in turn."""
    os.makedirs(folder, exist_ok=True)
    for run in runs:
        os.makedirs(run["folder"], exist_ok=True)
    preset = PRESETS[args.preset]
    lab_file = os.path.join(folder, "lab.json")
    with open(lab_file, "w") as f:
        json.dump({"stale_k": args.stale_k, "engine_int4": bool(preset.get("engine_int4")),
                   "random_reward": bool(preset.get("random_reward")),
                   "runs": [{k: r[k] for k in ("seed", "spec", "metrics", "step_log")} for r in runs]}, f, indent=1)
    cmd = [sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", *train_argv(task, runs[0], args, folder),
           "--drpo.plugin", "openrlhf_drpo.lab.pipe", "--drpo.plugin_config", lab_file]
    log_path = os.path.join(folder, "pipeline.log")
    current = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            m = _PROGRESS.search(line)
            if m and m.group(2):
                current = int(m.group(1))
                progress(runs[current], 0, None)
            elif m:
                progress(runs[current], int(m.group(3)), float(m.group(4)))
        rc = proc.wait()
    if rc != 0:
        tail = "".join(open(log_path).readlines()[-30:])
        raise SystemExit(f"{tail}\ndrpo-lab: error: drpo-train exited with {rc}; log: {log_path}")


def run_all(task, runs: list[dict], args) -> None:
    """The runs dealt round-robin to --parallel pipelines, side by side."""
    total, lock, done, started = len(runs), threading.Lock(), {}, time.monotonic()

    def progress(run, step, reward):
        with lock:
            index = runs.index(run) + 1
            done[index] = step
            if step == 0:
                _show(f"[{index}/{total}] {run['label']}: starting", 1)
            elif step < args.steps:
                _show(f"[{index}/{total}] {run['label']}: step {step}/{args.steps}  reward {reward:.3f}", step)
            else:        # a line per finished run, kept, with the study's estimated time left
                steps = sum(done.values())
                left = (time.monotonic() - started) / steps * (total * args.steps - steps)
                _show(f"[{index}/{total}] {run['label']}: done, final step's reward {reward:.3f}; "
                      f"{sum(s == args.steps for s in done.values())} of {total} runs done, about "
                      f"{left / 60:.0f} min left", step, last=True)
    groups = [runs[i::args.parallel] for i in range(args.parallel) if runs[i::args.parallel]]
    errors = []
    # each pipeline its own share of the GPUs (not yet run on GPUs); torch only where it matters
    gpus = __import__("torch").cuda.device_count() if len(groups) > 1 else 0

    def pipeline(i, group):
        env = None
        if gpus >= len(groups) > 1:
            share = gpus // len(groups)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(i * share, (i + 1) * share)))}
        try:
            run_pipeline(task, group, args, os.path.join(args.out, "pipelines", f"p{i}"), progress, env)
        except SystemExit as e:
            errors.append(e)
    threads = [threading.Thread(target=pipeline, args=(i, g)) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def collect(run, args) -> dict:
    """A finished run's result row and curves, from the lab's per-step and per-update logs."""
    lines = [json.loads(x) for x in open(run["metrics"])] if os.path.exists(run["metrics"]) else []
    steps = [x for x in lines if "step" in x]
    if not steps:
        raise SystemExit(f"drpo-lab: error: {run['label']}: no step recorded in {run['metrics']}")
    updates = [json.loads(x) for x in open(run["step_log"])] if os.path.exists(run["step_log"]) else []
    wall = sum(x["wall_s"] for x in lines if "wall_s" in x)
    row = {"objective": _label(run["name"], run["params"]), "params": run["params"], "seed": run["seed"],
           "preset": args.preset, **summarize(steps, updates), "wall_s": round(wall, 1)}
    return {"row": row, "curves": curves(steps, updates)}


# ---------------------------------------------------------------- seeds aggregated


def analysis_lines(specs) -> tuple[str, tuple]:
    """Each objective's analysis, one line: what to compare the measurements against; as text
    (the console's) and as (head, rows) for results.md."""
    import dsl
    from openrlhf_drpo.analysis.orchestrator import analyze
    from openrlhf_drpo.analysis.present.comparison import comparison, comparison_rows
    results = []
    for name, params in specs:
        res = analyze(dsl.load(name).with_overrides(params, where="drpo-lab"))
        res["name"] = _label(name, params)
        results.append(res)
    warnings = [f"{r['name']}: {w}" for r in results for w in r.get("warnings", [])]
    rows = comparison_rows(results)
    table = (rows[0] + ["warnings"], [row + ["; ".join(w for w in r.get("warnings", []))]
                                       for row, r in zip(rows[1:], results)])
    return comparison(results) + ("\nwarnings\n" + "\n".join("  " + w for w in warnings) if warnings else ""), table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drpo-lab", description=__doc__.split("\n")[0],
                                epilog="presets: " + "; ".join(f"{k}: {v['updates']} updates/rollout, lr {v['lr']:g}, "
                                                              f"stresses {v['stresses']}" for k, v in PRESETS.items()))
    p.add_argument("objectives", nargs="+", metavar="OBJECTIVE[:NAME=VALUE,...]")
    p.add_argument("--version", action="version", version=f"drpo-lab {__version__}")
    p.add_argument("--preset", choices=list(PRESETS), default="mild")
    p.add_argument("--seeds", type=int, default=3, help="runs per objective, seeds 0..N-1 (default: 3)")
    p.add_argument("--steps", type=int, default=40, help="rollouts (training steps) per run (default: 40)")
    p.add_argument("--updates", type=int, default=None, help="optimizer steps per rollout (default: the preset's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the preset's)")
    p.add_argument("--stale-k", type=int, default=None,
                   help="sync the engine's weights every K steps (default: the stale preset's 4, else 1)")
    p.add_argument("--parallel", type=int, default=1, help="pipelines side by side, each taking its share of the runs")
    p.add_argument("--pretrain-steps", type=int, default=150, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join("runs", "lab"),
                   help="folder for results.json, results.md, results.html, curves.png and the logs (default: runs/lab)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = parser()
    args = p.parse_args(argv)
    args.extra = extra
    preset = PRESETS[args.preset]
    args.updates = preset["updates"] if args.updates is None else args.updates
    args.lr = preset["lr"] if args.lr is None else args.lr
    args.stale_k = preset.get("stale_k", 1) if args.stale_k is None else args.stale_k
    if min(args.seeds, args.steps, args.updates, args.stale_k, args.parallel) < 1 \
            or (ROLLOUT_PROMPTS * SAMPLES) % args.updates or not args.lr > 0:
        p.error(f"--seeds, --steps, --stale-k and --parallel must be at least 1, --updates must divide "
                f"{ROLLOUT_PROMPTS * SAMPLES} and --lr be positive")
    if preset.get("engine_int4") and __import__("torch").cuda.is_available():
        p.error("--preset mismatch rounds the engine's weights in CPU mode's vLLM worker; on GPUs, run it with "
                "CUDA_VISIBLE_DEVICES= (CPU mode)")
    from dsl import DslError, parse_spec
    try:
        specs = [parse_spec(t) for t in args.objectives]
        predicted, predicted_table = analysis_lines(specs)      # checks every objective before anything runs
        runs = plan(specs, args)
        if not __import__("torch").cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        refuse_untrainable(runs, args)
    except DslError as e:
        print(e.render(), file=sys.stderr)
        return 1
    from openrlhf_drpo.lab import task as labtask
    os.makedirs(args.out, exist_ok=True)
    custom = args.updates != preset["updates"] or args.stale_k != preset.get("stale_k", 1)
    print(f"drpo-lab: preset {args.preset} ({args.updates} updates per rollout, lr {args.lr:g}"
          f"{f', engine synced every {args.stale_k} steps' if args.stale_k > 1 else ''}): "
          f"{preset['stresses']}{' (overridden by the flags given)' if custom else ''}", flush=True)
    print(f"drpo-lab: {len(runs)} runs ({len(specs)} objectives x {args.seeds} seeds) on {args.parallel} "
          f"pipeline{'s' if args.parallel > 1 else ''}", flush=True)
    print("the task (tiny Llama pre-trained towards a Zipf distribution): ", end="", flush=True)
    task, reused = labtask.cached(pretrain_steps=args.pretrain_steps)
    print(f"{'reused' if reused else 'built'}, {os.path.dirname(task['model'])}", flush=True)
    start = time.time()
    run_all(task, runs, args)
    wall = time.time() - start
    results = [collect(run, args) for run in runs]
    rows = [r["row"] for r in results]
    summary = aggregate(rows)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"runs": rows, "summary": summary}, f, indent=2)
    title = f"drpo-lab: {', '.join(_label(n, p) for n, p in specs)} under {args.preset}"
    setting = (f"Preset `{args.preset}`: {args.updates} updates per rollout, lr {args.lr:g}"
               f"{f', engine synced every {args.stale_k} steps' if args.stale_k > 1 else ''}"
               f"{' (overridden by the flags given)' if custom else ''}; {preset['stresses']}. "
               f"{args.seeds} seed{'s' * (args.seeds != 1)} × {args.steps} steps per objective"
               f"{'; drpo-train flags: ' + ' '.join(args.extra) if args.extra else ''}.")
    page = markdown(rows, summary, title, setting, predicted_table)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(page)
    plot(results, os.path.join(args.out, "curves.png"))
    with open(os.path.join(args.out, "curves.png"), "rb") as f, \
            open(os.path.join(args.out, "results.html"), "w", encoding="utf-8") as out:
        out.write(html_page(page, f.read()))
    print(f"\npredicted (drpo-analyze)\n{predicted}\n\nmeasured (mean [95% t interval] over seeds; "
          f"{rank_rule(args.preset)})\n{summary_table(summary)}")
    print(f"trained {len(runs)} runs in {wall:.0f} s; wrote {args.out}/results.json, results.md, results.html, "
          f"curves.png; logs under {args.out}/pipelines and {args.out}/runs")
    return 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
