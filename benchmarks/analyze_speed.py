"""drpo-analyze speed: cold process wall time per shipped objective (start, imports, parse,
analysis, output), the whole library in one process, and a pathological set (issue 8: deep
nesting, high powers, huge constants, chained bindings, a 4 KB sum). Prints JSON. Targets:
<= 1.5 s per shipped objective cold and <= 6 s for the library (issue 3); every pathological
objective <= 2 s cold and never > 5 s, with exit 0 (issue 8).

    python3 benchmarks/analyze_speed.py [--repeat 3]
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dsl


def wall(cmd, check=True) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


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
    # issue 19: what the work budgets (dsl.analysis.BUDGET) must cut early, not a clock
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
}


def pathological(exe, repeat):
    """Cold time and exit status of each pathological objective (each file is at most 4 KB)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in PATHOLOGICAL.items():
            path = Path(tmp) / f"{name}.dsl"
            path.write_text(text + "\n")
            assert path.stat().st_size <= 4096, name
            rc = subprocess.run([exe, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            out[name] = {"s": round(statistics.median(wall([exe, str(path)], check=False) for _ in range(repeat)), 3),
                         "exit": rc, "bytes": path.stat().st_size}
    return out


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
    patho = pathological(exe, args.repeat)
    slowest = max(v["s"] for v in patho.values())
    out = {
        "per_objective_cold_s": {n: round(t, 3) for n, t in per.items()},
        "max_per_objective_s": round(max(per.values()), 3),
        "library_one_process_s": round(library, 3),
        "python_sympy_numpy_import_s": round(baseline, 3),
        "pathological_cold_s": patho,
        "max_pathological_s": slowest,
        "targets": {"per_objective_s": 1.5, "library_s": 6.0, "pathological_s": 2.0, "pathological_never_s": 5.0},
        "meets_targets": {"per_objective": max(per.values()) <= 1.5, "library": library <= 6.0,
                          "pathological": slowest <= 2.0, "pathological_never": slowest <= 5.0,
                          "pathological_exit_0": all(v["exit"] == 0 for v in patho.values())},
        "repeat": args.repeat,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
