"""drpo-analyze speed: cold process wall time per shipped objective (start, imports, parse,
analysis, output) and the whole library in one process. Prints JSON. Targets (issue 3):
<= 1.5 s per objective cold, <= 6 s for the library in one process, on a 2-core machine.

    python3 benchmarks/analyze_speed.py [--repeat 3]
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

import dsl


def wall(cmd) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported")
    args = ap.parse_args()
    exe = shutil.which("drpo-analyze") or sys.exit("drpo-analyze is not installed (bash scripts/setup.sh)")
    names = dsl.shipped_names()
    wall([exe, "surrogate"])    # warm the OS file cache and Lark's grammar cache once
    per = {n: statistics.median(wall([exe, n, "--json"]) for _ in range(args.repeat)) for n in names}
    library = statistics.median(wall([exe, *names, "--json"]) for _ in range(args.repeat))
    baseline = statistics.median(wall([sys.executable, "-c", "import sympy, numpy"]) for _ in range(args.repeat))
    out = {
        "per_objective_cold_s": {n: round(t, 3) for n, t in per.items()},
        "max_per_objective_s": round(max(per.values()), 3),
        "library_one_process_s": round(library, 3),
        "python_sympy_numpy_import_s": round(baseline, 3),
        "targets": {"per_objective_s": 1.5, "library_s": 6.0},
        "meets_targets": {"per_objective": max(per.values()) <= 1.5, "library": library <= 6.0},
        "repeat": args.repeat,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
