"""OpenRLHF 0.11.2's own PolicyLoss options, written as objectives.

`policy_loss_text(**PolicyLoss kwargs)` is the objective file that equals
`PolicyLoss(**kwargs)` (loss and gradient; tests/test_sequence.py holds every valid
configuration to PolicyLoss itself), and `is_correction_factor(...)` is the factor its
train/rollout mismatch correction multiplies the per-token loss by. drpo-train composes that
factor with any objective (`compose`), so OpenRLHF's --algo.advantage.is_correction_* flags
keep their meaning when the objective replaces PolicyLoss.

PolicyLoss's other options come from train_ppo_ray flags that nothing else reads (SUPERSEDED):
drpo-train refuses them when set, naming the objective's equivalent, and

    python3 -m openrlhf_drpo.hosts.openrlhf.options --actor.eps_clip 0.1 ... > policy_loss.dsl

writes the objective that is PolicyLoss with them.
"""
from __future__ import annotations

import argparse
import sys
import dsl
from dsl.ir import num
from dsl.printing import render
from fractions import Fraction

# π_old/π_rollout as PolicyLoss computes it: exp of the log-prob difference (no exp/log round trip)
IS_RATIO = "exp(log(π_old) - log(π_rollout))"
# the sampled token's probabilities, clamped as PolicyLoss clamps them to keep binary KL's logs finite
_P, _Q = "clip(π_rollout, 1e-6, 1 - 1e-6)", "clip(π_old, 1e-6, 1 - 1e-6)"
_GATES = {
    "ratio": "log(π_old) - log(π_rollout)",     # at seq level the ratio's geometric mean: exp of the mean log
    "binary_kl": f"{_P}*log({_P}/{_Q}) + (1 - {_P})*log((1 - {_P})/(1 - {_Q}))",
    "tv": f"|{_P} - {_Q}|",
}


def _number(x) -> str:
    return render(num(Fraction(repr(float(x)))))


def check_is_correction(level: str, mode: str, gating: str, threshold) -> None:
    """PolicyLoss's own validation, with its messages (a ValueError)."""
    if level not in {"off", "token", "seq"}:
        raise ValueError(f"is_correction_level must be off/token/seq, got {level}")
    if mode not in {"mask", "clip"}:
        raise ValueError(f"is_correction_mode must be mask/clip, got {mode}")
    if gating not in {"ratio", "binary_kl", "tv"}:
        raise ValueError(f"is_correction_gating must be ratio/binary_kl/tv, got {gating}")
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        raise ValueError("is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio")
    if gating != "ratio" and level != "off" and threshold[0] > 0:
        raise ValueError(f"is_correction_gating={gating} takes an upper bound only (a single delta)")


def is_correction_factor(level: str, mode: str = "mask", gating: str = "ratio", threshold=(0.5, 5.0)) -> str | None:
    """The factor (objective text) PolicyLoss multiplies each token's loss by, or None when off.
    The gated statistic is the token's, or its response's mean (seq); out-of-band units are
    dropped (mask: survivors keep the token IS weight π_old/π_rollout) or the ratio is clamped."""
    check_is_correction(level, mode, gating, threshold)
    if level == "off":
        return None
    low, high = (_number(t) for t in threshold)
    if mode == "clip":
        return f"clip({IS_RATIO}, {low}, {high})"
    stat = _GATES[gating]
    if level == "seq":
        stat = f"seq_mean({stat})"
    if gating == "ratio":
        stat = f"exp({stat})"
    return f"[{stat} >= {low} and {stat} <= {high}]*{IS_RATIO}"


def policy_loss_text(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=None, token_level_loss=True,
                     policy_loss_type="ppo", is_correction_level="off", is_correction_mode="mask",
                     is_correction_gating="ratio", is_correction_threshold=(0.5, 5.0)) -> str:
    """The objective file equal to PolicyLoss(**the same arguments)."""
    if policy_loss_type not in ("ppo", "gspo"):
        raise ValueError(f"Invalid policy loss type: {policy_loss_type}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    check_is_correction(is_correction_level, is_correction_mode, is_correction_gating, is_correction_threshold)
    gspo = policy_loss_type == "gspo"
    args = [f"policy_loss_type={policy_loss_type}", f"clip_eps_low={clip_eps_low}", f"clip_eps_high={clip_eps_high}"]
    args += [f"dual_clip={dual_clip}"] * (dual_clip is not None)
    if is_correction_level != "off":
        args += [f"is_correction_level={is_correction_level}", f"is_correction_mode={is_correction_mode}",
                 f"is_correction_gating={is_correction_gating}",
                 f"is_correction_threshold={list(is_correction_threshold)}"]
    lines = [f"# OpenRLHF 0.11.2 PolicyLoss({', '.join(args)})",
             f"@aggregate = {'token-mean' if token_level_loss and not gspo else 'seq-mean-token-mean'}"]
    # GSPO with the correction on takes its sequence ratio against the rollout policy instead
    lines.append(f"@anchor = {'rollout' if gspo and is_correction_level != 'off' else 'old'}")
    lines += [f"ε_low = {_number(clip_eps_low)}", f"ε_high = {_number(clip_eps_high)}"]
    if dual_clip is not None:
        lines.append(f"c = {_number(dual_clip)}")
    if gspo:    # GSPO: the geometric mean of the token ratios, unclamped
        lines.append("x = exp(seq_mean(log(π) - log(μ)))")
    else:
        lines.append("x = r")
    lines.append("L = min(x*A, clip(x, 1 - ε_low, 1 + ε_high)*A)")
    body = "L" if dual_clip is None else "[A >= 0]*L + [A < 0]*max(L, c*A)"
    factor = None if gspo else is_correction_factor(is_correction_level, is_correction_mode, is_correction_gating,
                                                     is_correction_threshold)
    lines.append(body if factor is None else f"{factor}*({body})")
    return "\n".join(lines) + "\n"


# OpenRLHF 0.11.2's train_ppo_ray flags that only PolicyLoss reads (ppo_actor.py builds it from
# them, and the objective replaces it): flag → (its parser's add_argument keywords, the objective's
# equivalent at the values given). drpo-train refuses each one the command line sets, at any value.
SUPERSEDED = {
    "actor.eps_clip": (dict(type=float, default=0.2),
                       "the objective's clip parameters: --drpo.set eps_low={0} --drpo.set eps_high={0} (ppo, "
                       "grpo_clip_higher)"),
    "actor.eps_clip_low_high": (dict(type=float, nargs=2, default=None),
                                "the objective's clip parameters: --drpo.set eps_low={0} --drpo.set eps_high={1} "
                                "(ppo, grpo_clip_higher)"),
    "actor.dual_clip": (dict(type=float, default=None), "the objective ppo_dual_clip, with --drpo.set c={0}"),
    "actor.policy_loss_type": (dict(choices=["ppo", "gspo"], default="ppo"),
                               "the objective {0} (--drpo.objective {0}), with its own clip parameters"),
    "actor.loss_agg_mode": (dict(choices=["token-mean", "seq-mean-token-mean"], default="token-mean"),
                            "the objective file's aggregation line, @aggregate = {0}"),
}


def _flags_parser(defaults: bool) -> argparse.ArgumentParser:
    """A parser of the SUPERSEDED flags alone; without defaults, those not given stay unset."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag, (kwargs, _) in SUPERSEDED.items():
        parser.add_argument("--" + flag, **(kwargs if defaults else {**kwargs, "default": argparse.SUPPRESS}))
    return parser


def superseded_flags(argv: list[str]) -> dict:
    """{flag: value} for the SUPERSEDED flags that the (train_ppo_ray) command line sets, at any value, spelled out or
    abbreviated as argparse resolves them: a parser of these flags alone, whose absent ones
    stay unset (an abbreviation OpenRLHF's own parser accepts is unique there, and here). A
    command line it cannot read raises the parser's error (parser.error), printing nothing."""
    parser = _flags_parser(defaults=False)
    parser.error = _unreadable
    given = vars(parser.parse_known_args(argv)[0])
    return {flag: given[flag] for flag in SUPERSEDED if flag in given}


def _unreadable(message):
    raise ValueError(message)


def superseded_message(argv: list[str]) -> str | None:
    """drpo-train's refusal of PolicyLoss's own flags, each naming the objective's equivalent,
    and the command that writes PolicyLoss with them as an objective file (None: none is set)."""
    flags = superseded_flags(argv)
    if not flags:
        return None
    values = {flag: v if isinstance(v, list) else [v] for flag, v in flags.items()}
    shown = [f"--{flag} {' '.join(map(str, v))}" for flag, v in values.items()]
    lines = [f"drpo-train: error: {', '.join(shown)}: OpenRLHF's PolicyLoss reads {'these' if len(flags) > 1 else 'this'}"
             ", and the objective replaces PolicyLoss, so drpo-train would ignore "
             f"{'them' if len(flags) > 1 else 'it'}; drop {'them' if len(flags) > 1 else 'it'}. In the objective:"]
    lines += [f"  --{flag}: {SUPERSEDED[flag][1].format(*v)}" for flag, v in values.items()]
    lines += ["To train PolicyLoss itself with these settings, write it as an objective file and train that:",
              f"  python3 -m openrlhf_drpo.hosts.openrlhf.options {' '.join(shown)} > policy_loss.dsl",
              "  drpo-train --drpo.objective policy_loss.dsl ..."]
    return "\n".join(lines)


def refuse_superseded(argv: list[str]) -> None:
    message = superseded_message(argv)
    if message:
        raise SystemExit(message)


def refused_help(flag: str) -> str:
    """The --help text of a SUPERSEDED flag: refused, and the objective's equivalent."""
    kwargs, equivalent = SUPERSEDED[flag]
    values = ("LOW", "HIGH") if kwargs.get("nargs") == 2 else (flag.split(".")[-1].upper(),)
    return ("REFUSED by drpo-train (only PolicyLoss reads it, and the objective replaces PolicyLoss); "
            f"instead: {equivalent.format(*values)}")


def policy_loss_kwargs(ns) -> dict:
    """PolicyLoss's arguments from the SUPERSEDED flags' values, as OpenRLHF 0.11.2 builds them
    (cli/train_ppo_ray.py's eps_clip_low_high default, trainer/ray/ppo_actor.py's call)."""
    g = lambda flag: getattr(ns, flag)    # noqa: E731
    low, high = g("actor.eps_clip_low_high") or (g("actor.eps_clip"),) * 2
    return dict(clip_eps_low=low, clip_eps_high=high, dual_clip=g("actor.dual_clip"),
                token_level_loss=g("actor.loss_agg_mode") == "token-mean", policy_loss_type=g("actor.policy_loss_type"))


def main(argv: list[str] | None = None) -> int:
    """Prints the objective file equal to PolicyLoss under these train_ppo_ray flags."""
    parser = _flags_parser(defaults=True)
    parser.prog = "python3 -m openrlhf_drpo.hosts.openrlhf.options"
    parser.description = "print the objective file equal to OpenRLHF 0.11.2's PolicyLoss under these flags"
    parser.add_argument("-h", "--help", action="help")
    kwargs = policy_loss_kwargs(parser.parse_args(sys.argv[1:] if argv is None else argv))
    try:
        sys.stdout.write(policy_loss_text(**kwargs))
    except ValueError as e:
        parser.error(str(e))
    return 0


def compose(obj: dsl.Objective, factor: str) -> dsl.Objective:
    """`factor · objective`, as one objective (its own text, parameters and options kept)."""
    *head, last = obj.canonical().split("\n")
    text = "\n".join([f"# {obj.name}, times OpenRLHF's train/rollout IS correction", *head, f"{factor}*({last})"])
    composed = dsl.parse(text, f"{obj.path} × IS correction")
    if obj.params.get("step"):      # canonical() writes a set step as a comment (the file cannot set it)
        composed = composed.with_overrides({"step": str(obj.params["step"])}, where="--drpo.set")
    composed.name = obj.name
    return composed


if __name__ == "__main__":
    sys.exit(main())
