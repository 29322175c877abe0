"""drpo-analyze speed: cold process wall time per shipped objective (start, imports, parse,
analysis, output), the whole library in one process, and a pathological set (issue 8: deep
nesting, high powers, huge constants, chained bindings, a 4 KB sum; issue 19: many μ-dependent
clips, nested min/max, long sums of exp/log, r^127, long binding chains, many thresholds).
Prints JSON. Targets: <= 1.5 s per shipped objective cold and <= 6 s for the library (issue 3);
<= 2 s of CPU per shipped objective cold (issue 45);
every pathological objective <= 2 s cold and never > 5 s, with exit 0 (issue 8); the hang guard
(openrlhf_drpo.analysis.budgets.HANG_SECONDS) never fires: the work budgets (openrlhf_drpo.analysis.budgets.BUDGET) bound every run
(issue 19). Each time is the median wall time; cpu_s (the child's user + system time) is given
beside it, since on a shared machine wall time also counts other processes.

    python3 benchmarks/analyze_speed.py [--repeat 3] [--against DIR]

--against DIR times the same commands with the code checked out in DIR (`git worktree add DIR
COMMIT`), run by this interpreter, each run beside the current one: `before_s` and `ratio` (now /
before, lower is faster) on every row, so a claim that the analysis did not get slower is a
ratio measured in one run on one machine, not two numbers from two days.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dsl


AGAINST = None     # --against DIR
# Each child writes and reads its bytecode, as an installed package does, but in a temporary
# directory (the tree stays as it is): with PYTHONDONTWRITEBYTECODE set (this sandbox sets it)
# every run compiled the analysis's modules again, about 0.2 s a run.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd, check=True) -> float:
    return run(cmd, check)[0]


def run(cmd, check=True, env=None, cwd=None):
    """(wall s, child cpu s, stdout) of one cold process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=check, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env={**CHILD_ENV, **(env or {})}, cwd=cwd)
    elapsed = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu, proc


def timed(cmd, repeat, check=True) -> dict:
    """Median wall and cpu time over `repeat` cold runs of a --json command, its exit status,
    and whether the hang guard fired in any of them."""
    runs, before = [], []
    for _ in range(repeat):
        runs.append(run(cmd, check))
        if AGAINST:     # the earlier code's run right after, under the same conditions
            # (in DIR: `python -m` puts the working directory ahead of PYTHONPATH)
            before.append(run([sys.executable, "-m", "openrlhf_drpo.cli", *cmd[1:]], False,
                              {"PYTHONPATH": AGAINST}, cwd=AGAINST))
    fired = False
    for _, _, proc in runs:
        try:
            data = json.loads(proc.stdout)
        except ValueError:
            continue
        fired |= any(d["hang_guard"]["fired"] for d in (data if isinstance(data, list) else [data]))
    out = {"s": round(statistics.median(r[0] for r in runs), 3), "cpu_s": round(statistics.median(r[1] for r in runs), 3),
           "exit": runs[-1][2].returncode, "hang_guard_fired": fired}
    if AGAINST:
        b, ok = statistics.median(r[0] for r in before), before[-1][2].returncode == 0
        # a run the earlier code could not do (an objective it lacks) has no ratio
        out.update(before_s=round(b, 3) if ok else None, before_exit=before[-1][2].returncode,
                   ratio=round(out["s"] / b, 3) if ok else None)
    return out


PATHOLOGICAL = {
    "abs_nested_300": "abs(" * 300 + "r*A" + ")" * 300,
    "log_nested_150": "log(1 + " * 150 + "r" + ")" * 150 + "*A",
    "sqrt_nested_100": "sqrt(" * 100 + "r" + ")" * 100 + "*A",
    "min_nested_150": "min(" * 150 + "r*A" + ", clip(r, 0.8, 1.2)*A)" * 150,
    "parentheses_2000": "(" * 2000 + "r*A" + ")" * 2000,
    "power_128": "A*r^128",
    "power_1000": "A*r^1000/1000",
    "huge_constant": "r*A*1e200*1e200",
    "chained_bindings_40": "\n".join(["b0 = r"] + [f"b{i} = b{i - 1}*b{i - 1}" for i in range(1, 40)] + ["b39*A"]),
    "sum_of_89_clips_4kb": " + ".join(f"min(r*A, clip(r, {1 - i / 1000:.3f}, {1 + i / 1000:.3f})*A)"
                                      for i in range(1, 90)),
    # issue 19: what the work budgets (openrlhf_drpo.analysis.budgets.BUDGET) must cut early, not a clock
    "mu_clips_12": " + ".join(f"min(r*A, clip(r, 1 - {i / 100:g}*μ, 1 + {i / 50:g}*μ)*A)" for i in range(1, 13)),
    "mu_clips_nested_8": "min(" * 8 + "r*A" + "".join(f", clip(r, 1 - {i / 20:g}*μ, 1 + {i / 10:g})*A)"
                                                      for i in range(1, 9)),
    "minmax_nested_40": "".join("min(" if i % 2 else "max(" for i in range(40)) + "r*A"
                        + "".join(f", {1 + i / 100:g}*μ*A)" for i in range(40)),
    "exp_log_sum_60": " + ".join(f"exp({i / 50:g}*(r - 1))*A/{i} + log(r + {i})*A" for i in range(1, 61)),
    "power_127": "A*r^127",
    "poly_degree_9": "A*(r - 1.1)*(r - 1.2)*(r - 1.3)*(r - 0.5)*(r - 0.6)*(r - 0.7)*(r - 0.8)*(r - 0.9)*(r - 2)*(r - 3)",
    "bindings_chain_150": "\n".join(["b0 = r"] + [f"b{i} = b{i - 1} + r/{i}" for i in range(1, 150)] + ["b149*A"]),
    "thresholds_40": "[" + " or ".join(f"(r > {1 + i / 50:g} and r < {1 + i / 50 + 0.01:g})" for i in range(40))
                     + "]*r*A",
    "mu_thresholds_30": "[" + " or ".join(f"(π - μ > {i / 100:g}*μ and r < {1 + i / 40:g})" for i in range(30))
                        + "]*r*A",
    # issue 36: an advantage weighted by the entropy (a v3 construct), with a clip (2.6 s CPU cold before)
    "entropy_weighted_clip": "ψ = 0.4\nAe = A + min(ψ*sg(H), |A|/2)\nmin(r*Ae, clip(r, 0.8, 1.28)*Ae)",
}


def pathological(exe, repeat):
    """Cold time, exit status and the hang guard of each pathological objective (each file is
    at most 4 KB)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in PATHOLOGICAL.items():
            path = Path(tmp) / f"{name}.dsl"
            path.write_text(text + "\n")
            assert path.stat().st_size <= 4096, name
            out[name] = {**timed([exe, str(path), "--json"], repeat, check=False), "bytes": path.stat().st_size}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported")
    ap.add_argument("--against", metavar="DIR", help="a checkout of earlier code, timed beside each run")
    args = ap.parse_args()
    global AGAINST
    AGAINST = args.against and str(Path(args.against).resolve())
    # the console script installed beside this interpreter (a virtual environment's bin/): the
    # one on PATH may be a version manager's shim, pyenv's adds about 0.3 s to every run
    beside = Path(sys.executable).parent / "drpo-analyze"
    exe = str(beside) if beside.exists() else shutil.which("drpo-analyze")
    exe = exe or sys.exit("drpo-analyze is not installed (bash scripts/setup.sh)")
    names = [n for n in dsl.shipped_names() if not dsl.load(n).facts.vocabulary]    # (refused: no r-analysis)
    cache = tempfile.mkdtemp(prefix="analyze-speed-pycache-")
    CHILD_ENV["PYTHONPYCACHEPREFIX"] = cache
    wall([exe, "surrogate"])    # warm the OS file cache, the bytecode and Lark's grammar cache once
    if AGAINST:
        run([sys.executable, "-m", "openrlhf_drpo.cli", "surrogate"], False, {"PYTHONPATH": AGAINST}, cwd=AGAINST)
    per = {n: timed([exe, n, "--json"], args.repeat) for n in names}
    library = timed([exe, *names, "--json"], args.repeat)
    baseline = statistics.median(wall([sys.executable, "-c", "import sympy, numpy"]) for _ in range(args.repeat))
    patho = pathological(exe, args.repeat)
    worst = max(v["s"] for v in per.values())
    slowest = max(v["s"] for v in patho.values())
    fired = [n for n, v in {**per, **patho}.items() if v["hang_guard_fired"]] + \
        (["library"] if library["hang_guard_fired"] else [])
    out = {
        "per_objective_cold": per,
        "max_per_objective_s": worst,
        "max_per_objective_cpu_s": max(v["cpu_s"] for v in per.values()),
        "library_one_process": library,
        "python_sympy_numpy_import_s": round(baseline, 3),
        "pathological_cold": patho,
        "max_pathological_s": slowest,
        "max_pathological_cpu_s": max(v["cpu_s"] for v in patho.values()),
        "hang_guard_fired": fired,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "targets": {"per_objective_s": 1.5, "per_objective_cpu_s": 2.0, "library_s": 6.0, "pathological_s": 2.0,
                    "pathological_never_s": 5.0},
        "meets_targets": {"per_objective": worst <= 1.5, "library": library["s"] <= 6.0,
                          "per_objective_cpu": max(v["cpu_s"] for v in per.values()) <= 2.0,     # issue 45
                          "pathological": slowest <= 2.0, "pathological_never": slowest <= 5.0,
                          "pathological_exit_0": all(v["exit"] == 0 for v in patho.values()),
                          "hang_guard_never_fired": not fired},
        "repeat": args.repeat,
        "drpo_analyze": exe,
    }
    if AGAINST:      # issue 19: the library must not get slower
        both = [v for v in per.values() if v["ratio"] is not None]
        out["against"] = {
            "dir": AGAINST, "library_ratio": library["ratio"],
            "objectives_compared": len(both),
            "max_per_objective_s": max(v["s"] for v in both),
            "max_per_objective_before_s": max(v["before_s"] for v in both),
            "per_objective_ratio_median": statistics.median(v["ratio"] for v in both),
            "per_objective_ratio_max": max(v["ratio"] for v in both),
            "pathological_ratio_max": max((v["ratio"] for v in patho.values() if v["ratio"] is not None), default=None)}
        a = out["against"]
        out["meets_targets"]["not_slower"] = (a["max_per_objective_s"] <= a["max_per_objective_before_s"]
                                              and (library["ratio"] or 2) <= 1)
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
