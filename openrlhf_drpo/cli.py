"""drpo-analyze: parse objectives and report what they do to each token's gradient."""
from __future__ import annotations

import argparse
import sys

from dsl import DslError, load


def _overrides(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise DslError("expected name=value", "--set", 1, 1, pair, "e.g. --set delta=0.2")
        out[name.strip()] = value
    return out


def analyze_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="drpo-analyze", description=__doc__)
    ap.add_argument("objectives", nargs="+", metavar="FILE_OR_NAME",
                    help="a .dsl file or the name of a shipped objective (e.g. drpo)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter (ASCII or Unicode name)")
    ap.add_argument("--traceback", action="store_true", help="show Python tracebacks for errors")
    args = ap.parse_args(argv)
    try:
        overrides = _overrides(args.set)
        for spec in args.objectives:
            obj = load(spec)
            mine = {k: v for k, v in overrides.items() if len(args.objectives) == 1 or k in obj.params}
            obj = obj.with_overrides(mine, where="--set")
            print(f"# {obj.name} ({obj.path})")
            print(obj.canonical())
    except DslError as e:
        if args.traceback:
            raise
        print(e.render(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(analyze_main())
