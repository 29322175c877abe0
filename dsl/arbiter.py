"""The numeric arbiter: facts about an objective found with the IR's own float rules (the
rules the compiled loss follows), never with SymPy, so that they check the symbolic
derivation independently. Its first fact is the on-policy weight."""
from __future__ import annotations

import math

from .ir import derivative, evaluate

# μ across six decades and |A| across six: a value that holds on all of them is reported as a
# number, one that does not as the interval it spans
MUS = (1e-6, 1e-3, 0.1, 0.5, 1.0)
MAGNITUDES = (1e-3, 1.0, 1e3)
SIGNS = (("positive", 1.0), ("negative", -1.0))


def on_policy(obj) -> dict:
    """w and ℓ at r = 1 (π = μ), per sign of A: what the first mini-batch of every PPO-style
    step sees. status: "ok" (w > 0), "zero" (no on-policy gradient), "negative" (the gradient
    opposes A), "undefined" (ℓ or w is 0/0, a pole, or not a finite double there)."""
    dl = derivative(obj.expr)        # ∂ℓ/∂r at fixed μ and A, by the IR's rules
    params = {k: float(v) for k, v in obj.params.items()}
    out = {}
    for adv, sign in SIGNS:
        ws, undefined = [], None
        for mu in MUS:
            for mag in MAGNITUDES:
                env = {"r": 1.0, "mu": mu, "pi": mu, "A": sign * mag, **params}
                try:
                    ell, w = evaluate(obj.expr, env), evaluate(dl, env) / (sign * mag)
                except (ValueError, ZeroDivisionError, OverflowError):
                    undefined = undefined or "ℓ or w is 0/0, a pole or outside its domain"
                    continue
                if not math.isfinite(ell):
                    undefined = "ℓ is not finite"
                elif not math.isfinite(w):
                    undefined = undefined or "w is not finite"
                else:
                    ws.append(w)
        lo, hi = (min(ws), max(ws)) if ws else (None, None)
        status = ("undefined" if undefined else "zero" if hi == lo == 0 else
                  "negative" if lo < 0 else "zero" if lo == 0 else "ok")
        out[adv] = {"w": [lo, hi], "status": status, "why": undefined}
    return out


def on_policy_warnings(facts: dict) -> list[str]:
    out = []
    for adv, sign_text in (("positive", "A > 0"), ("negative", "A < 0")):
        f = facts[adv]
        if f["status"] == "undefined":
            out.append(f"on policy (r = 1, the first mini-batch of every step) for {sign_text}: {f['why']} "
                       "there, so the compiled loss is NaN or inf on it")
        elif f["status"] == "zero":
            out.append(f"on policy (r = 1) for {sign_text}, w = 0 at some μ or |A|: those tokens get no gradient "
                       "until the policy has moved")
        elif f["status"] == "negative":
            out.append(f"on policy (r = 1) for {sign_text}, w < 0 at some μ or |A|: the gradient pushes against "
                       "the advantage from the first update")
    return out
