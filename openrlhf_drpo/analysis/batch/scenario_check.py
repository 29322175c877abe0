"""Each scenario's claim held to the compiled loss's own gradient on that scenario's batch: the
batch the held point describes (G responses per group with advantages A·c, |y| tokens that share r
and μ, the held H, π_ref, staleness and ρ), through CompiledLoss's plain path in float64. The
token's weight is autograd's ∂loss/∂log π at the analysed token over the same for the plain
surrogate r·A with the objective's options: the aggregation weight cancels. Torch is imported
here only, on request (drpo-analyze --check-loss): without it the check is 'not run', said so."""
from __future__ import annotations

import math

from dsl.ir import Node
from dsl.objective import Objective
from dsl.walks import derivative, numpy_plan
from openrlhf_drpo.analysis.batch.held import held_group, spread

# where each scenario is checked: off policy on both sides of r = 1 and on it, both signs of A. The
# advantages are dyadic, so that a group's sum of equal ones is exact: the loss's group mean of eight
# 0.7's is 0.7000000000000001 (index_add's rounding), and its std then 1e-16, not 0 (see the report)
POINTS = tuple((r, 0.25, a) for r in (0.75, 1.0, 1.125, 1.5) for a in (0.75, -0.75))
LONG = 64        # past this |y|, a batch of 8 points' responses costs seconds: r = 1.125, both signs, only
RTOL = 1e-7
# the loss's inputs the batch gives (CompiledLoss.inputs()); any other is not checked, by name
GIVEN = ("groups", "rollout_log_probs", "ref_log_probs", "entropy", "sum_pi_sq", "turns", "staleness", "batch")


def not_checkable(obj: Objective, group: tuple) -> str | None:
    """Why the token's own gradient is not the weight the scenario claims, or None."""
    if spread(obj, group):
        return ("w there is ∂ℓ/∂r with every response's r moving together, not one token's own gradient (a group "
                "or batch reduction that reads A passes a gradient)")
    if any(r.gradient and r.over == "prefix" for r in obj.facts.reductions):
        return "w at position p is ∂ℓ_p/∂r with the whole prefix moving together, not token p's own gradient"
    return None


def check(obj: Objective, rho: float, points: list[dict], weights: list) -> list[dict]:
    """Per held point (analysis.batch.view's keywords; `weights[i]`: w(r, μ, A) of its view by the IR's
    float rules, nan where undefined): {'status': 'agrees' | 'disagrees' | 'not checked' | 'not
    run', and 'points' or 'where' or 'why'}."""
    try:
        import torch

        from openrlhf_drpo.core import CompiledLoss
    except ImportError:
        return [{"status": "not run", "why": "torch is not installed (the analyser-only install): pip install "
                                             "'openrlhf-drpo[train]' to hold the claims to the compiled loss"}] * len(points)
    loss = CompiledLoss(obj, fused=False)
    unknown = [k for k in loss.inputs() if k not in GIVEN]
    if unknown:
        return [{"status": "not checked", "why": f"the batch would need {', '.join(unknown)}"}] * len(points)
    plain = CompiledLoss(Objective(obj.name, obj.path, "r*A", Node("mul", (Node("var", value="r"),
                                                                              Node("var", value="A"))),
                                   {}, dict(obj.options), {}, ""), fused=False)
    out = []
    for point, w in zip(points, weights):
        group = held_group(point.get("group_size"), point.get("group"))
        why = not_checkable(obj, group)
        if why:
            out.append({"status": "not checked", "why": why})
            continue
        # every point its own group of one batch, where no batch reduction couples them
        together = "batch" not in loss.inputs()
        chosen = POINTS if point.get("seq_len", 1) <= LONG else POINTS[4:6]
        got = (_token_weights(torch, loss, plain, obj, rho, point, group, chosen) if together else
               [w for x in chosen for w in _token_weights(torch, loss, plain, obj, rho, point, group, [x])])
        bad = next(({"r": r, "mu": mu, "A": a, "loss": _plain(g), "analysis": _plain(float(w(r, mu, a)))}
                    for (r, mu, a), g in zip(chosen, got) if not _agree(g, float(w(r, mu, a)))), None)
        out.append({"status": "disagrees", "where": bad} if bad else {"status": "agrees", "points": len(chosen)})
    return out


def _agree(got: float, want: float) -> bool:
    if not (math.isfinite(got) and math.isfinite(want)):
        return not math.isfinite(got) and not math.isfinite(want)
    return abs(got - want) <= RTOL * max(abs(got), abs(want)) + 1e-12


def _plain(x: float):
    return float(x) if math.isfinite(x) else None


def _token_weights(torch, loss, plain, obj, rho, point, group, points) -> list[float]:
    """Autograd's weight at the analysed token (the first response's, at position p) of each point's
    batch, the points' batches stacked as groups of one call (their responses share no group)."""
    G, T = len(group), point.get("seq_len", 1)
    N = point.get("batch_size") or G
    p = point.get("position") or T
    k = len(points)
    c = torch.tensor([float(x) for x in group] * (N // G), dtype=torch.float64)
    col = lambda values: torch.tensor(values, dtype=torch.float64).repeat_interleave(N)[:, None]   # noqa: E731
    r, mu, a = (col([x[i] for x in points]) for i in range(3))
    old = torch.log(mu).expand(k * N, T).contiguous()
    adv = (a * c.repeat(k)[:, None]).expand(k * N, T).contiguous()
    mask = torch.ones(k * N, T, dtype=torch.bool)
    held = {"H": 1.0, "rho_ref": 1.0, "staleness": 1.0, **{k_: float(v) for k_, v in (point.get("held") or {}).items()}}
    grads = []
    for fn in (loss, plain):
        logp = (old + torch.log(r)).requires_grad_()
        extra, reads = {}, fn.inputs()
        if "groups" in reads:
            extra["groups"] = torch.arange(k * N) // G
        if "rollout_log_probs" in reads:     # ρ = π_old/π_rollout; μ is the anchor's policy
            extra["rollout_log_probs"] = old - math.log(rho) if obj.options["anchor"] == "old" else old
        if "ref_log_probs" in reads:
            extra["ref_log_probs"] = old + math.log(held["rho_ref"])
        if "entropy" in reads:
            extra["entropy"] = torch.full((k * N, T), held["H"], dtype=torch.float64, requires_grad=True)
        if "sum_pi_sq" in reads:
            pi = (mu * r).expand(k * N, T)
            extra["sum_pi_sq"] = pi * pi + (1 - pi) ** 2
        if "turns" in reads:
            extra["turns"] = torch.zeros(k * N, T, dtype=torch.long)
        if "staleness" in reads:
            extra["staleness"] = torch.full((k * N, T), held["staleness"], dtype=torch.float64)
        anchor = old + math.log(rho) if "rollout_log_probs" in reads and obj.options["anchor"] == "rollout" else old
        value, _ = fn(logp, anchor, adv, mask, **extra)
        (g,) = torch.autograd.grad(value, logp, allow_unused=True)
        grads.append(torch.zeros(k * N, T, dtype=torch.float64) if g is None else g.detach())
    mine, surrogate = (g[::N, p - 1] for g in grads)
    return [float(x) / float(y) if float(y) != 0 else math.nan for x, y in zip(mine, surrogate)]


def weight_at(view: Objective):
    """w(r, μ, A) of a view at one point by the IR's float rules (nan where undefined)."""
    import numpy as np
    run = numpy_plan(view.expr, derivative(view.expr))
    params = {k: float(v) for k, v in view.params.items()}

    def w(r, mu, a):
        ell, dl = run({**params, "r": np.float64(r), "mu": np.float64(mu), "pi": np.float64(mu * r), "A": np.float64(a)})
        with np.errstate(all="ignore"):
            x = float(dl) / a
        return x if np.isfinite(float(ell)) and np.isfinite(x) else float("nan")
    return w
