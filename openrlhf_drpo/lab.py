"""drpo-lab: run several objectives through the real drpo-train pipeline on a synthetic task
built to stress trust regions, and compare their training stability, on a laptop.

    drpo-lab OBJECTIVE[:NAME=VALUE,...]... [--preset on-policy|mild|stress] [--seeds N]
             [--steps N] [--updates N] [--lr LR] [--out DIR] [-- DRPO_TRAIN_FLAGS...]

Each objective (a shipped name or a .dsl file, with optional overrides: `drpo:delta=0.2`)
runs once per seed, in CPU mode on CPU or on GPUs when present. The task (labtask.py) is
built once in DIR/task. Writes DIR/results.json, DIR/results.md and DIR/curves.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

# Off-policy depth: each rollout (8 prompts x 4 samples) is cut into `updates` mini-batches,
# one optimizer step each, all measured against the same rollout policy.
PRESETS = {
    "on-policy": {"updates": 1, "lr": 2e-3,
                  "stresses": "nothing: one update per rollout, every update starts on-policy (the control)"},
    "mild": {"updates": 8, "lr": 2e-3,
             "stresses": "8 updates per rollout: the policy drifts up to 7 updates away from the rollout policy"},
    "stress": {"updates": 16, "lr": 1e-2,
               "stresses": "16 updates per rollout at 5x the learning rate: far off-policy, where unprotected "
                           "objectives collapse"},
}
ROLLOUT_PROMPTS, SAMPLES = 8, 4
FINAL_STEPS = 5
# A run has collapsed when, over its last FINAL_STEPS steps, responses are mostly target words
# (mean target fraction >= 0.5) yet hold at most 2 distinct ones (mean reward <= 2/8): the
# policy found the targets and then narrowed onto one or two of them.
COLLAPSE_FRACTION, COLLAPSE_REWARD = 0.5, 2 / 8
RESULT_KEYS = ("objective", "params", "seed", "preset", "final_reward", "reward_auc", "max_grad_norm",
               "max_token_weight", "collapsed", "dead_steps", "wall_s")


def parse_spec(text: str):
    """`name` or `name:k=v,k=v` -> (name, {k: v}); the objective itself is checked by dsl.load."""
    name, _, rest = text.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise SystemExit(f"drpo-lab: error: {text!r}: expected OBJECTIVE or OBJECTIVE:NAME=VALUE,... "
                             f"(got {item!r})")
        params[key.strip()] = value.strip()
    return name, params


def collapsed(steps: list[dict]) -> bool:
    tail = steps[-FINAL_STEPS:]
    if not tail:
        return False
    fraction = statistics.mean(s.get("target_fraction", 0.0) for s in tail)
    return fraction >= COLLAPSE_FRACTION and statistics.mean(s["reward"] for s in tail) <= COLLAPSE_REWARD


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def summarize(steps: list[dict], updates: list[dict]) -> dict:
    """A run's row from its per-step log (OpenRLHF's) and per-update log (the step log)."""
    rewards = [s["reward"] for s in steps]
    per_step = {}
    for u in updates:
        per_step.setdefault(u["step"], []).append(u)
    return {
        "final_reward": statistics.mean(rewards[-FINAL_STEPS:]) if rewards else None,
        "reward_auc": statistics.mean(rewards) if rewards else None,
        "max_grad_norm": max(_finite(u.get("grad_norm") for u in updates), default=None),
        "max_token_weight": max(_finite(u.get("max_token_weight") for u in updates), default=None),
        "collapsed": collapsed(steps),
        "dead_steps": sum(all(u["dead"] for u in us) for us in per_step.values()),
    }


def curves(steps: list[dict], updates: list[dict]) -> dict:
    """Per step: reward, the largest grad norm and token weight over its updates, and the
    engine/trainer mismatch: max |log r| on its first update, where π is still the trainer's
    copy of the rollout policy."""
    out = {"step": [s["step"] for s in steps], "reward": [s["reward"] for s in steps]}
    by_step = {}
    for u in updates:
        by_step.setdefault(u["step"], []).append(u)
    for key in ("grad_norm", "max_token_weight"):
        out[key] = [max(_finite(u.get(key) for u in by_step.get(s, [])), default=None) for s in out["step"]]
    first = {s: us[0] for s, us in by_step.items() if us and us[0]["update"] == 0}
    out["mismatch"] = [max(abs(math.log(first[s]["ratio_max"])), abs(math.log(first[s]["ratio_min"])))
                       if s in first and "ratio_min" in first[s] else None for s in out["step"]]
    return out


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


def run_one(task, name, params, seed, args, label) -> dict:
    """One drpo-train run; returns its result row and curves."""
    from openrlhf_drpo import toytask
    folder = os.path.join(args.out, "runs", _slug(name, params, seed))
    os.makedirs(folder, exist_ok=True)
    step_log = os.path.join(folder, "steps.jsonl")
    if os.path.exists(step_log):
        os.remove(step_log)
    flags = toytask.flags(task, folder, steps=args.steps, rollout_prompts=ROLLOUT_PROMPTS, samples=SAMPLES,
                          seed=seed, lr=args.lr, updates=args.updates)
    cmd = [sys.executable, "-m", "openrlhf_drpo.train", "--drpo.objective", name, "--drpo.anchor", "rollout",
           *[a for k, v in params.items() for a in ("--drpo.set", f"{k}={v}")], *flags,
           "--actor.lr_scheduler", "constant", "--drpo.step_log", step_log, *args.extra]
    log_path = os.path.join(folder, "train.log")
    start, steps = time.time(), []
    _show(f"{label}: starting (Ray, vLLM, DeepSpeed)", 0)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            for s in toytask.steps_from_log(line):
                steps.append(s)
                _show(f"{label}: step {s['step']}/{args.steps}  reward {s.get('reward', float('nan')):.3f}",
                              s["step"])
        rc = proc.wait()
    wall = time.time() - start
    if rc != 0:
        tail = "".join(open(log_path).readlines()[-30:])
        raise SystemExit(f"{tail}\ndrpo-lab: error: {label}: drpo-train exited with {rc}; log: {log_path}")
    updates = [json.loads(x) for x in open(step_log)] if os.path.exists(step_log) else []
    row = {"objective": _label(name, params), "params": params, "seed": seed, "preset": args.preset,
           **summarize(steps, updates), "wall_s": round(wall, 1)}
    if not steps:
        raise SystemExit(f"drpo-lab: error: {label}: drpo-train logged no step; log: {log_path}")
    _show(f"{label}: done in {wall:.0f} s, final reward {row['final_reward']:.3f}", args.steps, last=True)
    return {"row": row, "curves": curves(steps, updates), "log": log_path}


def analysis_lines(specs) -> str:
    """Each objective's analysis, one line: what to compare the measurements against."""
    import dsl
    from dsl.analysis import analyze
    from dsl.report import comparison
    results = []
    for name, params in specs:
        res = analyze(dsl.load(name).with_overrides(params, where="drpo-lab"))
        res["name"] = _label(name, params)
        results.append(res)
    warnings = [f"  {r['name']}: {w}" for r in results for w in r.get("warnings", [])]
    return comparison(results) + ("\nwarnings\n" + "\n".join(warnings) if warnings else "")


def markdown(rows: list[dict]) -> str:
    cols = [k for k in RESULT_KEYS if k != "params"]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("reward", "reward (distinct targets / 8)", False), ("grad_norm", "grad norm before clipping (max)", True),
              ("max_token_weight", "max |∂ℓ/∂log π| / |A| (per step)", True),
              ("mismatch", "engine/trainer mismatch: max |log r|, first update", False)]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title, log) in zip(axes.flat, panels):
        for i, run in enumerate(runs):       # one colour per run in every panel
            c = run["curves"]
            points = [(s, v) for s, v in zip(c["step"], c[key]) if v is not None and (v > 0 or not log)]
            if points:
                ax.plot(*zip(*points), color=f"C{i % 10}", label=f"{run['row']['objective']} (seed {run['row']['seed']})")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if log and ax.has_data():
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="drpo-lab", description=__doc__.split("\n")[0],
                                epilog="presets: " + "; ".join(f"{k}: {v['updates']} updates/rollout, lr {v['lr']:g}, "
                                                              f"stresses {v['stresses']}" for k, v in PRESETS.items()))
    p.add_argument("objectives", nargs="+", metavar="OBJECTIVE[:NAME=VALUE,...]")
    p.add_argument("--preset", choices=list(PRESETS), default="mild")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--updates", type=int, default=None, help="optimizer steps per rollout (default: the preset's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the preset's)")
    p.add_argument("--pretrain-steps", type=int, default=150, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join("runs", "lab"))
    args = p.parse_args(argv)
    args.extra = extra
    preset = PRESETS[args.preset]
    args.updates = preset["updates"] if args.updates is None else args.updates
    args.lr = preset["lr"] if args.lr is None else args.lr
    if min(args.seeds, args.steps, args.updates) < 1 or (ROLLOUT_PROMPTS * SAMPLES) % args.updates or not args.lr > 0:
        p.error(f"--seeds and --steps must be at least 1, --updates must divide {ROLLOUT_PROMPTS * SAMPLES} "
                "and --lr be positive")
    specs = [parse_spec(t) for t in args.objectives]
    from dsl import DslError
    try:
        predicted = analysis_lines(specs)      # checks every objective before anything runs
    except DslError as e:
        print(e.render(), file=sys.stderr)
        return 1
    if not __import__("torch").cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from openrlhf_drpo import labtask
    os.makedirs(args.out, exist_ok=True)
    print(f"drpo-lab: preset {args.preset} ({args.updates} updates per rollout, lr {args.lr:g}): "
          f"{PRESETS[args.preset]['stresses'] if args.updates == preset['updates'] else 'custom depth'}", flush=True)
    print("building the task (tiny Llama pre-trained towards a Zipf distribution) ...", flush=True)
    task = labtask.build(os.path.join(args.out, "task"), pretrain_steps=args.pretrain_steps)
    runs = []
    total = len(specs) * args.seeds
    for i, (name, params) in enumerate(specs):
        for seed in range(args.seeds):
            label = f"[{len(runs) + 1}/{total}] {_label(name, params)} seed {seed}"
            runs.append(run_one(task, name, params, seed, args, label))
    rows = [r["row"] for r in runs]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    table = markdown(rows)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    plot(runs, os.path.join(args.out, "curves.png"))
    print("\npredicted (drpo-analyze)\n" + predicted + "\n\nmeasured\n" + table)
    print(f"wrote {args.out}/results.json, results.md, curves.png; logs under {args.out}/runs")
    return 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
