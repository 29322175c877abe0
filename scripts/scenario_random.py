"""The random-objective run of issue 45 at full size: N seeded draws per seed over the group,
batch and indicator constructs (tests/scenario_objectives.py, whose small slice the suite runs),
each scenario's claim held to the compiled loss's gradient on that scenario's batch
(analysis.batch.scenario_check). Prints JSON: per seed the draws, the scenarios checked, how many agree,
disagree (a confident wrong claim), were not checkable (a gradient through a spread group), and
the first disagreements and errors in full.

    python scripts/scenario_random.py --seeds 0 1 2 --draws 1000
"""
import argparse
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import dsl  # noqa: E402
from openrlhf_drpo.analysis.batch.scenarios import scenario_analysis  # noqa: E402
from scenario_objectives import draws  # noqa: E402


def run(seed: int, n: int) -> dict:
    counts, examples, errors = collections.Counter(), [], []
    for i, text in enumerate(draws(seed, n)):
        if i and i % 50 == 0:      # progress, for a run that may be cut short: the counts so far
            print(json.dumps({"seed": seed, "draws_done": i, **dict(sorted(counts.items())),
                              "errors": len(errors)}), file=sys.stderr, flush=True)
        try:
            sc = scenario_analysis(dsl.parse(text, "rand.dsl"), 1.0, {"seq_len": 1}, check_loss=True)
        except Exception as e:      # noqa: BLE001 - every failure is reported, by objective
            errors.append({"objective": text, "error": f"{type(e).__name__}: {e}"})
            continue
        for s in (sc or {"scenarios": []})["scenarios"]:
            status = s["loss_check"]["status"]
            counts[status] += 1
            if status == "disagrees" and len(examples) < 10:
                examples.append({"objective": text, "scenario": s["name"], "where": s["loss_check"]["where"]})
    return {"seed": seed, "draws": n, "scenarios": sum(counts.values()), **dict(sorted(counts.items())),
            "disagreements": examples, "errors": errors[:10], "error_count": len(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--draws", type=int, default=1000)
    args = ap.parse_args()
    print(json.dumps([run(seed, args.draws) for seed in args.seeds], indent=2))


if __name__ == "__main__":
    main()
