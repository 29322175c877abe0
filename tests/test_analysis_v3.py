"""The analysis of the language's third version (issue 29 item 3): each objective's locality; the
weight on a uniform batch (N responses in groups of G, |y| tokens, position p) with π_ref, H, Σπ²
and the statistics a file names held at stated points; the entropy's own gradient channel; and
every claim with its evidence.

The per-token gradient is checked against autograd through the operation rows' torch text and
lang.lowerings' reduction helpers: the code core.codegen's plain path runs. (CompiledLoss does not
take π_ref, H, Σπ² or groups yet on this branch: torch_objective below runs that code directly.)"""
import functools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from openrlhf_drpo import lang
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.report import report, to_json
from openrlhf_drpo.lang.ir import postorder
from openrlhf_drpo.lang.levels import argument_level, levels
from openrlhf_drpo.lang.lowerings import TORCH_REDUCTIONS
from openrlhf_drpo.lang.operations import OPS
from openrlhf_drpo.lang.walks import constant_nodes, evaluate

K3 = "β = 0.04\nmin(r*A, clip(r, 0.8, 1.2)*A) - β*(π_ref/π - log(π_ref/π) - 1)"
ENTROPY_BONUS = "c = 0.01\nmin(r*A, clip(r, 0.8, 1.2)*A) + c*H"
ENTROPY_CLIP = "ε = 0.2\nmin(r*A, clip(r, 1 - ε*H, 1 + ε*H)*A)"
CTPO = ("c = 0.2\nL = sg(prefix_sum(log(r)) - log(r)) + log(r)\n"
        "min(exp(L)*A, exp(clip(L, -c*prefix_sum(1)^0.5, c*prefix_sum(1)^0.5))*A)")
OTB = ("W = prefix_sum(sg(1 - 2*π + sum_π_sq))\nB = [group_count(A) >= 2]*group_sum(A*W)/(group_sum(W) + 1e-8)\n"
       "r*(A - B)")
BATCH_ESS = ("ess = sg(batch_sum(r)^2/(batch_count(r)*batch_sum(r^2)))\n"
             "sg(clip(r, 0, ess))*log(π)*A - (1 - ess)*(exp(log(μ) - log(π)) - (log(μ) - log(π)) - 1)")
GROUP_REGRESSION = "β = 0.5\nx = β*seq_sum(log(π) - log(μ))\n-(x - group_mean(x) - (A - group_mean(A)))^2"
GROUP_GEOMETRIC = "s = exp(group_mean(seq_mean(log(r))))\nmin(s*A, clip(s, 0.8, 1.2)*A)"
BATCH_PENALTY = "r*A - 0.1*(batch_mean(r) - 1)^2"
# the batch's N·|y| tokens and N responses: w = N|y|/(4 + N|y|) − 0.02·N²·|y|·log(r)/(r·A)
BATCH_COUNTS = "r*A*batch_count(A)/(4 + batch_count(A)) - 0.01*batch_sum(seq_mean(log(r)))^2"


# ---------------------------------------------------------------- the rows' torch text on a batch
def torch_objective(obj, tensors: dict):
    """ℓ per token [B, T] by each operation row's torch text (constants folded, a group or batch
    reduction given its argument's level), as core.codegen writes the plain path."""
    params = {k: float(v) for k, v in obj.params.items()}
    level, constant = levels(obj.expr), constant_nodes(obj.expr)
    code, lines = {}, []
    for i, n in enumerate(postorder(obj.expr)):
        if n in constant:
            code[n] = repr(float(evaluate(n, params)))
            continue
        if n.op == "var":
            code[n] = n.value
            continue
        op, args = OPS[n.op], [code[a] for a in n.args]
        text = op.torch(*args, argument_level(n, level)) if op.over in ("group", "batch") else op.torch(*args)
        lines.append(f"v{i} = {text}")
        code[n] = f"v{i}"
    namespace = {"torch": torch, "math": math, "dtype": torch.float64, "pg": None, **tensors}
    exec(TORCH_REDUCTIONS, namespace)
    exec("\n".join(lines), namespace)
    return eval(code[obj.expr], namespace)


def uniform_batch(G=3, groups=2, length=4, T=6, logp=-1.1, anchor=-1.3, A=0.7, H=0.5, rho_ref=1.0, seed=0):
    """groups·G responses of `length` unmasked tokens (then padding), all sharing log π, log μ, A, H
    and log π_ref = log μ + log ρ_ref, with Σπ² = π² + (1 − π)² (the analysis's stated point); plus one
    empty response in a group of its own. Masked slots hold other values: nothing may read them."""
    g = torch.Generator().manual_seed(seed)
    B = G * groups + 1
    m = torch.zeros(B, T, dtype=torch.bool)
    m[:-1, :length] = True

    def filled(value):
        noise = torch.randn(B, T, generator=g, dtype=torch.float64) - 2
        return torch.where(m, torch.full((B, T), value, dtype=torch.float64), noise)
    t = {"logp": filled(logp), "anchor": filled(anchor), "A": filled(A), "H": filled(H)}
    pi = math.exp(logp)
    t["pi_ref"] = torch.exp(t["anchor"] + math.log(rho_ref))
    t["sum_pi_sq"] = filled(pi ** 2 + (1 - pi) ** 2)
    t["group"] = torch.tensor([b - b % G for b in range(B - 1)] + [B - 1])
    return t, m


def gradients(obj, t, m):
    """∂loss/∂log π and ∂loss/∂H of the token mean of ℓ, by autograd through the rows' torch text."""
    logp, H = t["logp"].clone().requires_grad_(), t["H"].clone().requires_grad_()
    env = {**t, "logp": logp, "H": H, "m": m, "r": torch.exp(logp - t["anchor"]), "pi": torch.exp(logp),
           "mu": torch.exp(t["anchor"]), "pi_old": torch.exp(t["anchor"]),
           "seq_len": m.sum(-1, keepdim=True).to(torch.float64).expand_as(logp)}
    ell = torch_objective(obj, env)
    loss = torch.where(m, ell, 0.0).sum() / m.sum()
    return torch.autograd.grad(loss, (logp, H), allow_unused=True)


# text, held values, whether w depends on the position p (a prefix reduction: checked at each p)
UNIFORM = [
    (K3, {"rho_ref": Fraction(3, 2)}, False),
    (ENTROPY_BONUS, {"H": Fraction(1, 2)}, False),
    (ENTROPY_CLIP, {"H": Fraction(1, 2)}, False),
    (CTPO, {}, True),
    (OTB, {}, True),
    (BATCH_ESS, {}, False),
    (GROUP_REGRESSION, {}, False),
    (GROUP_GEOMETRIC, {}, False),
    (BATCH_PENALTY, {}, False),
    (BATCH_COUNTS, {}, False),
]


@functools.lru_cache(maxsize=None)
def _weight(text, length, G, N, p, held):
    return analyze(lang.parse(text, "v3.dsl"), seq_len=length, group_size=G, batch_size=N, position=p,
                   held=dict(held)).w


@pytest.mark.parametrize("text, held, by_position", UNIFORM, ids=[t[0].split("\n")[-1][:40] for t in UNIFORM])
@pytest.mark.parametrize("logp, A", [(-1.1, 0.7), (-0.95, -1.6), (-1.5, 2.5)])
def test_on_a_uniform_batch_each_tokens_gradient_is_the_derived_weight(text, held, by_position, logp, A):
    """autograd's ∂loss/∂log π at every unmasked token is w·r·A/n (the token mean over n tokens),
    w from the analysis at the batch's own G, N, |y| and p: log r = 0.2 (inside a 0.8–1.2 clip),
    0.35 (beyond 1.2 and beyond 1 ± 0.2·H) and −0.2, with A of either sign."""
    obj = lang.parse(text, "v3.dsl")
    G, groups, length = 3, 2, 3
    t, m = uniform_batch(G, groups, length, logp=logp, A=A, H=float(held.get("H", 1)),
                         rho_ref=float(held.get("rho_ref", 1)))
    (grad, _) = gradients(obj, t, m)
    r, mu = math.exp(logp + 1.3), math.exp(-1.3)
    n = int(m.sum())
    for p in range(1, length + 1) if by_position else [length]:
        w = _weight(text, length, G, G * groups, p, tuple(sorted(held.items())))
        expected = float(np.asarray(w(r, mu, A))) * r * A / n
        at = grad[:-1, p - 1] if by_position else grad[m]
        assert torch.allclose(at, torch.full_like(at, expected), rtol=1e-9, atol=1e-15), (p, at, expected)
    assert torch.all(grad[~m] == 0)
