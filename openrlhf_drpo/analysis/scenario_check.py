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
from openrlhf_drpo.analysis.held import held_group, spread

# where each scenario is checked: off policy on both sides of r = 1 and on it, both signs of A
POINTS = tuple((r, 0.3, a) for r in (0.7, 1.0, 1.1, 1.5) for a in (0.7, -0.7))
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
    """Per held point (analysis.view's keywords; `weights[i]`: w(r, μ, A) of its view by the IR's
    float rules, nan where undefined): {'status': 'agrees' | 'disagrees' | 'not checked' | 'not
    run', and 'points' or 'where' or 'why'}."""
    try:
        import torch

        from openrlhf_drpo.core import CompiledLoss
    except ImportError:
        return [{"status": "not run", "why": "torch is not installed (the analyser-only install): pip install "
                                             "'openrlhf-drpo[train]' to hold the claims to the compiled loss"}] * len(points)
    unknown = [k for k in CompiledLoss(obj, fused=False).inputs() if k not in GIVEN]
    if unknown:
        return [{"status": "not checked", "why": f"the batch would need {', '.join(unknown)}"}] * len(points)
    loss = CompiledLoss(obj, fused=False)
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
        bad = None
        for r, mu, a in POINTS:
            got = _token_weight(torch, loss, plain, obj, rho, point, group, r, mu, a)
            want = float(w(r, mu, a))
            if not _agree(got, want):
                bad = {"r": r, "mu": mu, "A": a, "loss": _plain(got), "analysis": _plain(want)}
                break
        out.append({"status": "disagrees", "where": bad} if bad else {"status": "agrees", "points": len(POINTS)})
    return out


def _agree(got: float, want: float) -> bool:
    if not (math.isfinite(got) and math.isfinite(want)):
        return not math.isfinite(got) and not math.isfinite(want)
    return abs(got - want) <= RTOL * max(abs(got), abs(want)) + 1e-12


def _plain(x: float):
    return float(x) if math.isfinite(x) else None


def _token_weight(torch, loss, plain, obj, rho, point, group, r, mu, a) -> float:
    """Autograd's weight at the analysed token (the first response's, at position p) on the batch."""
    G, T = len(group), point.get("seq_len", 1)
    N = point.get("batch_size") or G
    p = point.get("position") or T
    c = torch.tensor([float(x) for x in group] * (N // G), dtype=torch.float64)
    old = torch.full((N, T), math.log(mu), dtype=torch.float64)
    adv = (a * c)[:, None].expand(N, T).contiguous()
    mask = torch.ones(N, T, dtype=torch.bool)
    held = {"H": 1.0, "rho_ref": 1.0, "staleness": 1.0, **{k: float(v) for k, v in (point.get("held") or {}).items()}}
    grads = []
    for fn in (loss, plain):
        logp = (old + math.log(r)).requires_grad_()
        extra = {}
        reads = fn.inputs()
        if "groups" in reads:
            extra["groups"] = torch.arange(N) // G
        if "rollout_log_probs" in reads:     # ρ = π_old/π_rollout; μ is the anchor's policy
            extra["rollout_log_probs"] = old - math.log(rho) if obj.options["anchor"] == "old" else old
        if "ref_log_probs" in reads:
            extra["ref_log_probs"] = old + math.log(held["rho_ref"])
        if "entropy" in reads:
            extra["entropy"] = torch.full((N, T), held["H"], dtype=torch.float64, requires_grad=True)
        if "sum_pi_sq" in reads:
            pi = mu * r
            extra["sum_pi_sq"] = torch.full((N, T), pi * pi + (1 - pi) ** 2, dtype=torch.float64)
        if "turns" in reads:
            extra["turns"] = torch.zeros(N, T, dtype=torch.long)
        if "staleness" in reads:
            extra["staleness"] = torch.full((N, T), held["staleness"], dtype=torch.float64)
        anchor = old + math.log(rho) if "rollout_log_probs" in reads and obj.options["anchor"] == "rollout" else old
        value, _ = fn(logp, anchor, adv, mask, **extra)
        (g,) = torch.autograd.grad(value, logp, allow_unused=True)
        grads.append(0.0 if g is None else float(g[0, p - 1]))
    with torch.no_grad():
        return grads[0] / grads[1] if grads[1] != 0 else math.nan
