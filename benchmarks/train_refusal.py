"""drpo-train's refusals: cold process wall time from start to exit for command lines it refuses
(issue 47, item 1), each beside drpo-analyze's refusal of the same objective in the same run.
Target: every refusal <= 2 s (drpo-train parses the objective, --drpo.set, PolicyLoss's refused
flags and the missing flags before it imports OpenRLHF, Ray, vLLM or torch), i.e. `within_budget`
true on every row. Each time is the median of --repeat cold runs; cpu_s (the child's user +
system time) is given beside it, since on a shared machine wall time also counts other processes.

    python3 benchmarks/train_refusal.py [--repeat 3]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BUDGET_S = 2.0


def run(cmd) -> tuple[float, float, int, str]:
    """(wall s, child cpu s, exit status, first stderr line) of one cold process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu, proc.returncode, (proc.stderr.splitlines() or [""])[0]


def timed(cmd, repeat) -> dict:
    runs = [run(cmd) for _ in range(repeat)]
    return {"wall_s": round(statistics.median(r[0] for r in runs), 3),
            "cpu_s": round(statistics.median(r[1] for r in runs), 3), "exit": runs[0][2], "says": runs[0][3][:100]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    train = [sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train"]
    analyze = [sys.executable, "-m", "openrlhf_drpo.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "bad.dsl")
        with open(bad, "w") as f:
            f.write("r*A +\n")
        cases = {   # name: (drpo-train's arguments, drpo-analyze's on the same objective or None)
            "bad objective file": (["--drpo.objective", bad, "--drpo.cpu_mode", "on"], [bad]),
            "bad --drpo.set": (["--drpo.objective", "drpo", "--drpo.set", "delta=x", "--drpo.cpu_mode", "on"],
                               ["drpo", "--set", "delta=x"]),
            "unknown objective": (["--drpo.objective", "dpro", "--drpo.cpu_mode", "on"], ["dpro"]),
            "refused flag, no objective": (["--actor.eps_clip", "0.2"], None),
        }
        rows = []
        for name, (train_args, analyze_args) in cases.items():
            row = {"case": name, "drpo_train": timed([*train, *train_args], args.repeat)}
            if analyze_args:
                row["drpo_analyze"] = timed([*analyze, *analyze_args], args.repeat)
                row["ratio_train_to_analyze"] = round(row["drpo_train"]["wall_s"] / row["drpo_analyze"]["wall_s"], 2)
            row["within_budget"] = row["drpo_train"]["wall_s"] <= BUDGET_S and row["drpo_train"]["exit"] != 0
            rows.append(row)
    print(json.dumps({"budget_s": BUDGET_S, "repeat": args.repeat, "rows": rows}, indent=2, ensure_ascii=False))
    return 0 if all(r["within_budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
