"""The differential test at scale (issue 46): N random objectives per seed (tests/random_objectives.py),
each on its adversarial batch (tests/adversarial_batches.py), every loss path against the independent
float64 reference (tests/reference_dual.py, tests/differential.py). Prints JSON: the parser's
discards by class, the fragile cases left out, the disagreements per path and per class (a class: the
path, the output, how it differs, and the operations of the minimized objective), each class's
smallest case (objective text and batch) found by the shrinker, and objectives per second.

    python3 benchmarks/differential.py [--objectives 10000] [--seeds 0 1 2] [--compiled 0]
                                       [--paths plain fused sync_free] [--no-shrink] [--items S:I ...]

--compiled K also runs the first K objectives of each seed through torch.compile (15-30 s each on CPU).
--items runs only the named draws (seed:index), printing each disagreement in full."""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import numpy as np  # noqa: E402

import differential as D  # noqa: E402
import dsl  # noqa: E402


def ops_of(text: str) -> tuple:
    """The operations of an objective (its class's signature), bindings inlined."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expr = dsl.parse(text).expr
    return tuple(sorted({n.op if n.op not in ("var", "num", "param") else "" for n in expr.walk()} - {""}))


def run(args) -> dict:
    discards, per_path, fragile, undefined = {}, collections.Counter(), 0, 0
    classes: dict = {}
    items = [tuple(map(int, s.split(":"))) for s in args.items] if args.items else \
        [(seed, i) for seed in args.seeds for i in range(args.objectives)]
    start, count = time.perf_counter(), 0
    for seed, i in items:
        spec, obj, b = D.item(seed, i, discards)
        paths = list(args.paths) + (["compiled"] if i < args.compiled else [])
        want, found = D.check(obj, b, paths=paths)
        count += 1
        fragile += want["fragile"]
        undefined += want["undefined"] and not want["fragile"]
        for d in found:
            per_path[d.path] += 1
        # one class per (path, output, kind) of this draw: the first output of each path, shrunk
        for d in {(d.path): d for d in reversed(found)}.values():
            small_spec, small_b = D.shrink(spec, b, d) if args.shrink else (spec, b)
            key = (d.path, d.output, d.kind, ops_of(small_spec.text()))
            case = D.case_text(small_spec, small_b)
            entry = classes.setdefault(key, {"count": 0, "items": [], "case": case})
            entry["count"] += 1
            entry["items"].append(f"{seed}:{i}")
            if len(case["objective"]) < len(entry["case"]["objective"]):
                entry["case"] = case
            if args.items:
                got = D.run_path(dsl.parse(small_spec.text()), small_b, d.path)
                ref = D.reference(dsl.parse(small_spec.text()), small_b)
                entry["values"] = {"got": {k: np.asarray(v).tolist() for k, v in got.items()},
                                   "want": {k: np.asarray(ref[k]).tolist() for k in D.OUTPUTS}}
    elapsed = time.perf_counter() - start
    by_class = [{"path": k[0], "output": k[1], "kind": k[2], "ops": list(k[3]), **v}
                for k, v in sorted(classes.items(), key=lambda kv: -kv[1]["count"])]
    return {"objectives": count, "seeds": args.seeds, "paths": list(args.paths), "compiled": args.compiled,
            "discarded": discards, "fragile_not_compared": fragile, "undefined_not_compared": undefined,
            "disagreements_per_path": dict(per_path), "objectives_with_a_disagreement": len({
                it for c in classes.values() for it in c["items"]}),
            "classes": by_class, "seconds": round(elapsed, 1),
            "objectives_per_second": round(count / elapsed, 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objectives", type=int, default=10_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--paths", nargs="+", default=list(D.PATHS[:3]), choices=D.PATHS[:3])
    p.add_argument("--compiled", type=int, default=0)
    p.add_argument("--no-shrink", dest="shrink", action="store_false")
    p.add_argument("--items", nargs="*")
    args = p.parse_args(argv)
    torch_threads = os.environ.get("DIFFERENTIAL_THREADS")
    if torch_threads:
        import torch
        torch.set_num_threads(int(torch_threads))
    print(json.dumps(run(args), indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
