"""The random-objective check of test_arbiter (every claim held to sympy.diff of the objective's
value on rows the arbiter never saw) at scale, outside the suite: N draws of a strategy on a
fixed seed, every failure kept (not shrunk), printed as JSON with the count of draws, of
confident wrong claims and of draws the check could not compare.

    PYTHONPATH=$PWD python3 tests/random_claims.py --strategy token --seed 1 --draws 1000
"""
import argparse
import json
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main():
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st
    import strategies
    from test_arbiter import _claims_hold_on_fresh_points
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="token", choices=["token", "research", "policy"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--draws", type=int, default=100)
    args = p.parse_args()
    strategy = {"token": strategies.TOKEN_OBJECTIVES, "research": strategies.RESEARCH_OBJECTIVES,
                "policy": strategies.POLICY_OBJECTIVES}[args.strategy]
    seen, failures, events = [], [], {}

    @seed(args.seed)
    @given(st.data())
    @settings(max_examples=args.draws, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    def run(data):
        text = data.draw(strategy)
        seen.append(text)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                e = _claims_hold_on_fresh_points(text)
            events[e] = events.get(e, 0) + 1
            print(f"ok {len(seen)} {text!r}", file=sys.stderr, flush=True)
        except AssertionError as exc:
            failures.append({"objective": text, "claim": str(exc)[:600]})
            print(f"FAIL {text!r}: {str(exc)[:300]}", file=sys.stderr, flush=True)
        except Exception:        # noqa: BLE001 - a crash is a finding too
            failures.append({"objective": text, "crash": traceback.format_exc()[-600:]})
            print(f"CRASH {text!r}", file=sys.stderr, flush=True)
    run()
    print(json.dumps({"strategy": args.strategy, "seed": args.seed, "draws": len(seen),
                      "distinct": len(set(seen)), "wrong_claims": len(failures), "events": events,
                      "failures": failures}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
