"""The words for each kind of warning (analysis.alerts' records), as the JSON's warnings and the
report print them: one sentence per kind, from the values the alert holds."""
from __future__ import annotations

from openrlhf_drpo.analysis.mathtext import fmt, math_text

_SIDE = {"positive": "A > 0", "negative": "A < 0"}


def _how(proven) -> str:
    return " (proven)" if proven else " (unconfirmed: evidence under the boundary above)"


def _boundaries(pis) -> str:
    return ", ".join(f"π = {math_text(p)}" for p in pis)


def _undefined(adv, at, below, above) -> str:
    parts = [f"at {at}"] if at else [f"below {below}"] * bool(below) + [f"above {above}"] * bool(above)
    return (f"for {_SIDE[adv]}, ℓ or w is undefined or not finite {' and '.join(parts)}: "
            "the compiled loss is NaN or inf on such tokens")


def _disagrees(bad_points, points, example) -> str:
    x = example
    return (f"THE DERIVED WEIGHT DISAGREES with the IR's own derivative at {bad_points} of {points} grid "
            f"points, e.g. μ = {x['mu']:.6g}, π = {x['pi']:.6g}, A = {x['A']:g}: derived {x['derived']:.6g}, "
            f"numeric {x['numeric']:.6g}")


TEXT = {
    "no gradient": lambda adv, proven:
        f"for {_SIDE[adv]}, w = 0 everywhere: these tokens get no gradient at all{_how(proven)}",
    "zero on part": lambda adv, proven, share:
        f"no trust-region boundary for {_SIDE[adv]}, but w = 0 on part of the domain ({100 * share:.3g}% of the "
        f"grid points): those tokens get no gradient{_how(proven)}",
    "zero on policy": lambda adv, proven:
        f"no trust-region boundary for {_SIDE[adv]}: w = 0 at r = 1 (see on policy) but does not change sign, "
        f"so nothing stops the update{_how(proven)}",
    "touches only": lambda adv, proven:
        f"no trust-region boundary for {_SIDE[adv]}: w reaches 0 only where it touches 0, so nothing stops the "
        f"update{_how(proven)}",
    "no boundary": lambda adv, proven:
        f"no trust-region boundary for {_SIDE[adv]}: w never reaches 0, so nothing stops the update{_how(proven)}",
    # the range is the 'bounded' line's claim, at its own evidence: not restated here at this one's
    "unreachable": lambda adv, pis, proven:
        f"the boundary for {_SIDE[adv]} ({_boundaries(pis)}) is unreachable: 0 < π, μ ≤ 1, so w never "
        f"cancels the gradient{_how(proven)}",
    "partly unreachable": lambda adv, pis, proven:
        f"for {_SIDE[adv]}, the boundary {_boundaries(pis)} is unreachable in 0 < π, μ ≤ 1{_how(proven)}",
    "numeric boundary": lambda adv, found, derived:
        f"for {_SIDE[adv]}, the numeric check finds w changing sign at "
        + "; ".join(f"{where} ({kind})" for where, kind in found)
        + (": the symbolic derivation found no boundary there" if derived else ""),
    "range unknown": lambda: "w is not a finite double at any sampled point: its range is unknown",
    "unbounded": lambda lo, hi:
        f"w is unbounded (range [{fmt(lo)}, {fmt(hi)}]): tokens with extreme ratios (rare tokens, small μ) can "
        "dominate the gradient",
    "unbounded in |A|": lambda lo, hi:
        f"w is unbounded (range [{fmt(lo)}, {fmt(hi)}]) as |A| → 0 or ∞, not by the ratio: tokens with extreme "
        "advantages (small or large |A|) can dominate the gradient",
    "entangled": lambda: "the weight depends on |A|: the trust region moves with the advantage's magnitude",
    "numeric range": lambda: "the range is numeric (sampled over the domain), not an exact bound",
    "weight disagrees": _disagrees,
    "range disagrees": lambda:
        "the derived range disagreed with the numeric check (whose extremes are refined between grid points); "
        "the numeric check's is shown",
    "self-check failed": lambda:
        "SELF-CHECK FAILED: the derived weight disagrees with finite differences of the objective",
    "self-check unconfirmed": lambda:
        "the weight is unconfirmed: too few points where the objective is a finite double to check it",
    "undefined": _undefined,
    "pole": lambda adv, where: f"for {_SIDE[adv]}, w has a pole at {where}: unbounded near it",
    "touches": lambda adv, where: f"for {_SIDE[adv]}, w touches 0 without changing sign at {where}",
    "undefined share": lambda fraction: f"ℓ or w is undefined at {100 * fraction:.3g}% of the sampled domain",
    "on policy undefined": lambda adv, why:
        f"on policy (r = 1, the first mini-batch of every step) for {_SIDE[adv]}: {why} there, so the compiled "
        "loss is NaN or inf on it",
    "on policy zero": lambda adv:
        f"on policy (r = 1) for {_SIDE[adv]}, w = 0 at some μ or |A|: those tokens get no gradient until the "
        "policy has moved",
    "on policy negative": lambda adv:
        f"on policy (r = 1) for {_SIDE[adv]}, w < 0 at some μ or |A|: the gradient pushes against the "
        "advantage from the first update",
    "by position": lambda text: f"{text} (the held point's responses share their length: not seen in w)",
    "degenerate held point": lambda adv, said:
        f"for {_SIDE[adv]}, w = 0 (or is not finite) everywhere at this held point only: {said}",
}


def alert_text(alert) -> str:
    """The warning's sentence; at a degenerate held point ('held': the status every claim there
    carries) led by it, since what it says is the held point's."""
    values = {k: v for k, v in alert.values.items() if k != "held"}
    text = TEXT[alert.kind](**values)
    return f"{alert.values['held']}: {text}" if alert.values.get("held") else text
