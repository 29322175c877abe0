"""drpo-analyze: what an objective does to each token's gradient, derived symbolically.

Never imports torch but for --check-loss: SymPy, NumPy and (for --plot) matplotlib only."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import textwrap
import warnings

from dsl import DslError, load, parse_spec, shipped_names
from dsl.errors import DslWarning
from dsl.objective import parse_overrides
from openrlhf_drpo import __version__
from openrlhf_drpo.analysis.batch.held import GROUP_SIZE


def _load_all(specs, overrides, held: list | None = None):
    """Each objective (FILE_OR_NAME or NAME:k=v,...: its own values first) takes the --set overrides
    naming its parameters; with `held` (drpo-analyze), those naming a value its analysis holds (H,
    rho_ref, a statistic's binding: analysis.batch.view.held_names) go to held[i], its own; a name no
    objective has is an error, and so is one set both ways."""
    from dsl.objective import param_key
    from dsl.vocabulary import refuse_r_analysis
    objs, own = [], []
    for spec in specs:
        name, params = parse_spec(spec)
        with warnings.catch_warnings(record=True) as caught:     # a definition never read, located
            warnings.simplefilter("always", DslWarning)
            obj = load(name)
        for w in caught:
            if issubclass(w.category, DslWarning):
                print(w.message, file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if held is not None:       # the analysis (not --emit-torch): refused, by name, where it does not apply
            refuse_r_analysis(obj)
        objs.append(obj.with_overrides(params, where="<command line>") if params else obj)
        own.append({param_key(k) for k in params})
    used = set()
    for i, obj in enumerate(objs):
        mine = {k: v for k, v in overrides.items() if param_key(k) in obj.params}
        for k in mine:
            if param_key(k) in own[i]:
                raise DslError(f"'{k}' is set twice: in '{specs[i]}' and by --set {k}={mine[k]}", "--set", 1, 1,
                               f"{k}={mine[k]}", "keep one of them")
        used |= set(mine)
        objs[i] = obj.with_overrides(mine, where="--set")
    rest = {k: v for k, v in overrides.items() if k not in used}
    if rest and held is not None:
        from openrlhf_drpo.analysis.batch.view import held_names
        for obj in objs:
            mine = {k: v for k, v in rest.items() if param_key(k) in held_names(obj)}
            used |= set(mine)
            held.append({param_key(k): _held_value(k, v) for k, v in mine.items()})
    unused = [k for k in overrides if k not in used]
    if unused:   # let the first objective report the unknown name with its located message
        objs[0].with_overrides({unused[0]: overrides[unused[0]]}, where="--set")
    return objs


def _held_value(name, value):
    """A held value from --set NAME=VALUE, a finite number the analysis can hold, as an exact Fraction."""
    from fractions import Fraction

    from openrlhf_drpo.analysis.batch.view import held_value_error
    text = f"{name}={value}"
    try:
        number = Fraction(str(value).strip())
        why = held_value_error(name, number)
    except (ValueError, ZeroDivisionError):
        number, why = None, "write a decimal number such as 0.2, .5 or 1e-3"
    if why:
        raise DslError(f"held value '{value}' for '{name}' is not one the analysis can hold", "--set", 1,
                       len(name) + 2, text, why)
    return number


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {'integer' if kind is int else 'number'}, got {text!r}")
        return value
    return parse


def _group(text):
    """--group 1,1,0,0: the held group (analysis.batch.held.held_group), each an exact number."""
    from fractions import Fraction

    from openrlhf_drpo.analysis.batch.held import held_group
    try:
        return held_group(None, [Fraction(part.strip()) for part in text.split(",")])
    except (ValueError, ZeroDivisionError) as e:
        why = (str(e) if "first response" in str(e) or "finite float" in str(e) else
               "write decimal numbers separated by commas, e.g. 1,1,0,0")
        raise argparse.ArgumentTypeError(f"--group {text!r}: {why}") from None


PLOT_FORMATS = (".png", ".pdf", ".svg")


def _check_plot_path(ap, path: str) -> None:
    """Before any work: the plot goes to exactly the file named, in a folder that exists."""
    if not path.strip():
        ap.error("--plot needs a file name, e.g. --plot weights.png")
    if os.path.isdir(path):
        ap.error(f"--plot {path}: is a directory; name a file in it, e.g. {os.path.join(path, 'weights.png')}")
    if os.path.splitext(path)[1].lower() not in PLOT_FORMATS:
        ap.error(f"--plot {path}: the file name must end in {', '.join(PLOT_FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        ap.error(f"--plot {path}: no such directory: {folder}")
    if importlib.util.find_spec("matplotlib") is None:     # the `plot` extra: said before the analysis, not after
        ap.exit(2, "drpo-analyze: error: --plot needs matplotlib, which is not installed: pip install '.[plot]' "
                   "(in the repository) adds it\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="drpo-analyze", description=__doc__.splitlines()[0])
    ap.add_argument("objectives", nargs="*", metavar="FILE_OR_NAME",
                    help="a .dsl file or the name of a shipped objective (e.g. drpo), either with its own "
                         "parameter values as NAME:k=v,... (e.g. drpo:delta=0.2)")
    ap.add_argument("--version", action="version", version=f"drpo-analyze {__version__}")
    ap.add_argument("--list", action="store_true", help="list the shipped objectives, one line each")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter (ASCII or Unicode name), e.g. --set delta=0.2")
    ap.add_argument("--sweep", metavar="NAME=V1,V2,...", default=None,
                    help="analyse one objective at each value of a parameter: one table of boundaries, range and "
                         "warnings, and with --plot one picture on one colour scale")
    ap.add_argument("--json", action="store_true", help="print JSON (a list when several objectives)")
    ap.add_argument("--plot", metavar="PATH.png", help="write heatmaps of w over (μ, π), like the paper's Figure 1")
    ap.add_argument("--seq-len", type=_positive(int), default=1, metavar="N",
                    help="a sequence objective is analysed on a response of N tokens that share r, μ and A (default 1)")
    ap.add_argument("--rho", type=_positive(float), default=1.0, metavar="X",
                    help="the train/rollout ratio π_old/π_rollout the analysis holds (default 1: no mismatch)")
    ap.add_argument("--group-size", type=_positive(int), default=None, metavar="G",
                    help=f"group reductions are analysed on a group of G responses (default {GROUP_SIZE}; see --group)")
    ap.add_argument("--group", type=_group, default=None, metavar="C1,...,CG",
                    help="the held group: its G responses' advantages as multiples of the analysed token's A, its own "
                         "response first (1), e.g. 1,1,0,0 (default: binary rewards with a spread, half the group "
                         "scoring A and half 0); sets G")
    ap.add_argument("--batch-size", type=_positive(int), default=None, metavar="N",
                    help="batch reductions are analysed on a batch of N such responses, a multiple of G (default G)")
    ap.add_argument("--position", type=_positive(int), default=None, metavar="P",
                    help="prefix reductions are analysed at the P-th token of the response, P ≤ --seq-len "
                         "(default: the last)")
    ap.add_argument("--scenarios", action="store_true",
                    help="list the objective's scenarios (the situations that change its gradient: a zero-variance "
                         "group, one success in G, a long response, a stale sample, ...) with each one's claim")
    ap.add_argument("--scenario", metavar="NAME", default=None,
                    help="analyse the objective in one of its scenarios (--scenarios lists them)")
    ap.add_argument("--check-loss", action="store_true",
                    help="hold each scenario's claim to the compiled loss's gradient on its batch (imports torch)")
    ap.add_argument("--equiv", action="store_true",
                    help="with two objectives: do they train identically? exit 0 equivalent, 1 not, 2 on errors")
    ap.add_argument("--emit-torch", action="store_true", help="print the generated torch code instead")
    ap.add_argument("--traceback", action="store_true", help="show Python tracebacks for errors")
    ap.add_argument("--completion", choices=["bash", "zsh"],
                    help="print a completion script for drpo-analyze, drpo-lab and drpo-train, e.g. "
                         "drpo-analyze --completion bash > ~/.drpo-completion.sh, then source it")
    return ap


def analyze_main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_intermixed_args(argv)      # drpo --set delta=0.2 spo: names after options too
    if args.completion:
        from openrlhf_drpo.completion import script
        print(script(ap, args.completion))
        return 0
    if args.list:
        return _list(ap, args)
    if not args.objectives:
        ap.error("name at least one objective (a .dsl file or a shipped name; --list lists them)")
    if args.group is not None and args.group_size not in (None, len(args.group)):
        ap.error(f"--group has {len(args.group)} responses but --group-size is {args.group_size}")
    args.group_given = args.group is not None
    args.group_size = len(args.group) if args.group is not None else args.group_size or GROUP_SIZE
    if args.plot is not None:
        _check_plot_path(ap, args.plot)
    if args.batch_size is not None and args.batch_size % args.group_size:
        ap.error(f"--batch-size {args.batch_size} is not a multiple of --group-size {args.group_size}: the uniform "
                 "batch holds whole groups")
    if args.position is not None and args.position > args.seq_len:
        ap.error(f"--position {args.position} is past the response's last token (--seq-len {args.seq_len})")
    if args.equiv:
        return _equiv(ap, args)
    try:
        held: list = []
        objs = _load_all(args.objectives, parse_overrides(args.set), None if args.emit_torch else held)
        if args.sweep is not None:
            objs, held, points = _swept(ap, args, objs, held)
        if args.emit_torch:
            from openrlhf_drpo.core.codegen import torch_source
            print("\n\n".join(torch_source(o) for o in objs))
            return 0
        from openrlhf_drpo.analysis.orchestrator import analyze
        from openrlhf_drpo.analysis.present.comparison import comparison
        from openrlhf_drpo.analysis.present.report import report, to_json
        results = []
        point = {"group_size": args.group_size, "batch_size": args.batch_size, "position": args.position,
                 "group": args.group}
        for obj, values in zip(objs, held or [{}] * len(objs)):
            try:
                results.append(analyze(obj, args.seq_len, args.rho, **point, held=values, scenario=args.scenario,
                                       check_loss=args.check_loss, memory=args.sweep is None))
            except ValueError as e:
                if args.scenario is None or not ("has no scenario" in str(e) or "would replace the given" in str(e)):
                    raise
                ap.error(f"--scenario {args.scenario}: {e}")
            except DslError:        # bad input the analysis locates (a batch quantile of A on a spread group)
                raise
            except Exception as e:   # a bug of ours, not bad input: say which objective, no traceback
                if args.traceback:
                    raise
                print(f"drpo-analyze: internal error while analysing {obj.path}: {type(e).__name__}: {e}\n"
                      "please report it with the objective file; --traceback shows where", file=sys.stderr)
                return 3
    except DslError as e:
        if args.traceback:
            raise
        print(e.render(), file=sys.stderr)
        return 1
    if args.scenarios and not args.json:
        from openrlhf_drpo.analysis.present.scenario_text import listing
        print("\n\n".join(listing(r.name, r.scenarios) for r in results))
        return 0
    if args.json:
        data = [to_json(r) for r in results]
        print(json.dumps(data if len(data) > 1 else data[0], indent=2, ensure_ascii=False))
    elif args.sweep is not None:     # a row per value, named by it; the plot's rows by the objective too
        from openrlhf_drpo.analysis.present.summary import wrap
        for res, value in zip(results, points):
            res.name = value
        print(f"{objs[0].name}: {points[0].split(' = ')[0]} swept\n\n" + comparison(results, first="value"))
        warned = [line for res in results for text in res["warnings"] for line in wrap(text, f"  {res.name}: ", "    ")]
        print("\nwarnings\n" + ("\n".join(warned) if warned else "  none"))
        for res, value in zip(results, points):
            res.name = f"{objs[0].name}, {value}"
    else:
        print("\n\n".join(report(r) for r in results))
        if len(results) > 1:
            print("\n" + comparison(results))
    if args.plot is not None:
        from openrlhf_drpo.analysis.present.plot import plot
        try:
            plot(results, args.plot)
        except OSError as e:
            print(f"drpo-analyze: error: cannot write --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"\nwrote {args.plot}")
    failed = [r["name"] for r in results if r["self_check"]["status"] == "failed"]
    if failed:
        print(f"drpo-analyze: self-check FAILED for {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


def _swept(ap, args, objs, held):
    """--sweep NAME=V1,V2,...: the one objective at each value, and each value as shown ("δ = 0.1")."""
    from dsl.names import display_name
    from dsl.objective import param_key
    if len(objs) != 1 or args.emit_torch or args.equiv:
        ap.error("--sweep analyses exactly one objective, without --emit-torch or --equiv")
    name, eq, values = args.sweep.partition("=")
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not eq or not name.strip() or len(values) < 2:
        ap.error(f"--sweep {args.sweep}: write NAME=V1,V2,... with at least two values, e.g. --sweep delta=0.1,0.2,1")
    if param_key(name.strip()) not in objs[0].params:
        objs[0].with_overrides({name.strip(): values[0]}, where="--sweep")     # its located error
    given = {param_key(k) for k in parse_spec(args.objectives[0])[1]} | {param_key(k) for k in parse_overrides(args.set)}
    if param_key(name.strip()) in given:
        ap.error(f"--sweep {args.sweep}: {name.strip()} is also set in '{args.objectives[0]}' or by --set; keep one")
    shown = display_name(param_key(name.strip()))
    swept = [objs[0].with_overrides({name.strip(): v}, where="--sweep") for v in values]
    return swept, held * len(values), [f"{shown} = {v}" for v in values]


def _list(ap, args) -> int:
    """One line per shipped objective: its name and what it is, from its file's header."""
    from dsl.library import header
    if args.objectives or args.json or args.plot or args.emit_torch or args.equiv or args.set or args.sweep:
        ap.error("--list takes no objective and no other option")
    names = shipped_names()
    width = max(map(len, names))
    room = 100 - width - 2      # a terminal's 100 columns, a longer header ending at a word with " …"
    print("\n".join(f"{name:<{width}}  {textwrap.shorten(header(name)[0], room, placeholder=' …')}"
                     for name in names))
    return 0


def _equiv(ap, args) -> int:
    """exit 0 equivalent, 1 not equivalent (with a witness), 2 on any error in either file."""
    if len(args.objectives) != 2 or args.plot or args.emit_torch:
        ap.error("--equiv compares exactly two objectives (FILE_OR_NAME FILE_OR_NAME), without --plot or --emit-torch")
    try:
        a, b = _load_all(args.objectives, parse_overrides(args.set))
        from dsl.vocabulary import refuse_r_analysis
        refuse_r_analysis(a), refuse_r_analysis(b)         # the comparison is in r too
        from openrlhf_drpo.analysis.equiv import equivalence
        from openrlhf_drpo.analysis.memory import equiv_points
        # with memory, at each value their controls and schedules take (analysis.memory): the first that differs
        points = equiv_points(a, b)
        for point in points:
            pair = [o.with_overrides({k: str(v) for k, v in point.items() if k in o.params}, where="--equiv")
                    for o in (a, b)]
            res = equivalence(*pair, args.seq_len, args.rho, group=args.group if args.group_given else None)
            if not res["equivalent"]:
                break
        if point or len(points) > 1:
            from dsl.names import display_name
            from openrlhf_drpo.analysis.mathtext import fmt
            shown = lambda p: ", ".join(f"{display_name(k)} = {fmt(float(v))}" for k, v in p.items()) or "as given"  # noqa: E731
            res["scope"]["memory"] = {"points": [shown(p) for p in points], "at": shown(point),
                                      "controls": [c.text() for c in a.controls.values()]}
    except DslError as e:
        if args.traceback:
            raise
        print(e.render(), file=sys.stderr)
        return 2
    except Exception as e:   # a bug of ours, not bad input: no traceback
        if args.traceback:
            raise
        print(f"drpo-analyze: internal error while comparing {args.objectives[0]} and {args.objectives[1]}: "
              f"{type(e).__name__}: {e}\nplease report it with the objective files; --traceback shows where",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=2, ensure_ascii=False))
    else:
        from openrlhf_drpo.analysis.present.equiv_report import equivalence_report
        print(equivalence_report(res))
    return 0 if res["equivalent"] else 1


def main() -> None:
    try:
        code = analyze_main()
        # Skip interpreter teardown (~0.25 s with SymPy loaded): everything is written and flushed.
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:   # the reader left (drpo-analyze ... | head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141            # 128 + SIGPIPE, as a shell pipeline reports it
    os._exit(code)


if __name__ == "__main__":
    main()
