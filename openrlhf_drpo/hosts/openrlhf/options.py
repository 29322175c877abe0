"""OpenRLHF 0.11.2's own PolicyLoss options, written as objectives.

`policy_loss_text(**PolicyLoss kwargs)` is the objective file that equals
`PolicyLoss(**kwargs)` (loss and gradient; tests/test_sequence.py holds every valid
configuration to PolicyLoss itself), and `is_correction_factor(...)` is the factor its
train/rollout mismatch correction multiplies the per-token loss by. drpo-train composes that
factor with any objective (`compose`), so OpenRLHF's --algo.advantage.is_correction_* flags
keep their meaning when the objective replaces PolicyLoss.
"""
from __future__ import annotations

from openrlhf_drpo import lang
from openrlhf_drpo.lang.ir import num
from openrlhf_drpo.lang.printing import render
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


def compose(obj: lang.Objective, factor: str) -> lang.Objective:
    """`factor · objective`, as one objective (its own text, parameters and options kept)."""
    *head, last = obj.canonical().split("\n")
    text = "\n".join([f"# {obj.name}, times OpenRLHF's train/rollout IS correction", *head, f"{factor}*({last})"])
    composed = lang.parse(text, f"{obj.path} × IS correction")
    composed.name = obj.name
    return composed
