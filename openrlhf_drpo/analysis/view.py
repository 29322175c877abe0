"""The objective the analysis studies, and what it stands for: a token-level objective in r,
μ and A. A sequence objective is studied on a response whose tokens share r, μ and A; one
that names the policy μ is not is studied at a held train/rollout ratio ρ, over which its
on-policy weight is also sampled."""
from __future__ import annotations

from fractions import Fraction

from openrlhf_drpo.lang.objective import Objective
from openrlhf_drpo.lang.operations import OPS
from openrlhf_drpo.lang.walks import numpy_plan, reads_whole_response, uniform_view


def analysis_view(obj: Objective, seq_len=1, rho=1) -> tuple[Objective, dict]:
    """The token-level objective in r, μ and A that is analysed, and what it stands for. A
    sequence objective is studied on a response whose tokens share r, μ and A (|y| = seq_len
    tokens): each reduction is its value there, r is the response's ratio, and every token's
    gradient is exactly the w·r·A derived for it. The policy μ is not is μ·ρ or μ/ρ, with ρ =
    π_old/π_rollout held at `rho`. Existing token-level objectives are unchanged."""
    names = obj.names()
    sequence = any(map(reads_whole_response, obj.expr.walk()))
    other = {"old": "pi_rollout", "rollout": "pi_old"}[obj.options["anchor"]]
    scope = {"sequence": sequence, "seq_len": seq_len if sequence else None,
             "mismatch": other in names, "rho": rho if other in names else None, "rho_name": None,
             "held": held_points(obj)}
    if not sequence and not names & {"pi_old", "pi_rollout", *V3_INPUTS}:
        return obj, scope
    rho_name = "rho" if "rho" not in obj.params else "rho_mismatch"
    expr = uniform_view(obj.expr, obj.options["anchor"], rho_name)
    used = {n.value for n in expr.walk() if n.op == "param"}
    params = dict(obj.params)
    for name, value in (("seq_len", seq_len), (rho_name, rho), ("H", HELD_ENTROPY)):
        if name in used:
            params[name] = Fraction(value)
    scope["rho_name"] = rho_name if rho_name in used else None
    view = Objective(obj.name, obj.path, obj.source, expr, params, dict(obj.options), {}, obj.description)
    return view, scope


V3_INPUTS = ("pi_ref", "H", "sum_pi_sq")
HELD_ENTROPY = 1        # nats: where H is held (a parameter of the view)
# What uniform_view holds for the language's third version, where the objective reads it. The
# analysis of these constructs is provisional (issue 29): its claims hold at these points only.
_HELD = {
    "pi_ref": "π_ref = μ (the reference is the behaviour policy)",
    "H": f"H = {HELD_ENTROPY} nat, a parameter (its own gradient channel is not analysed yet)",
    "sum_pi_sq": "Σ_v π_v² = π² + (1 − π)² (the rest of the mass on one other token), without gradient",
    "prefix": "prefix reductions at the response's last token (prefix_sum(x) = |y|·x)",
    "group": "group reductions over a group of this one response (group_sum(x) = group_mean(x) = x, "
             "group_std(x) = 0, group_count(x) = 1)",
    "batch": "batch reductions held on policy (r = 1, π = μ: one token does not move a batch statistic) over |y| "
             "tokens, or one response, like this one",
}


def held_points(obj: Objective) -> list[str]:
    """What the analysis holds fixed for the third version's inputs and reductions in obj."""
    read = obj.names() | {OPS[n.op].over for n in obj.expr.walk() if n.op in OPS and OPS[n.op].reduce}
    return [text for key, text in _HELD.items() if key in read]


MISMATCH_GRID = (1e-4, 1e4, 801)      # ρ = π_old/π_rollout, log-spaced


def mismatch_range(view: Objective, rho_name: str, dl) -> dict:
    """On policy (r = 1), over μ in [1e-6, 1], A = ±1 and ρ on MISMATCH_GRID: the range of w
    and the ρ where some token keeps a nonzero weight (outside it the objective filters it)."""
    import numpy as np
    rho = np.geomspace(*MISMATCH_GRID)
    mu = np.geomspace(1e-6, 1, 31)[:, None]
    run = numpy_plan(dl)
    params = {k: float(v) for k, v in view.params.items()}
    ws = [run({**params, "r": np.ones_like(mu), "mu": mu, "pi": mu, "A": a, rho_name: rho[None, :]})[0] / a
          for a in (1.0, -1.0)]
    w = np.broadcast_to(np.stack(ws), (2, mu.shape[0], rho.size))
    finite = w[np.isfinite(w)]
    kept = rho[np.any(np.isfinite(w) & (w != 0), axis=(0, 1))]
    return {"w": [float(finite.min()), float(finite.max())] if finite.size else [None, None],
            "kept": [float(kept.min()), float(kept.max())] if kept.size else None,
            "grid": list(MISMATCH_GRID), "status": "numeric"}
