"""The analysis of the language's third version (issue 29 item 3): each objective's locality; the
weight on a uniform batch (N responses in groups of G, |y| tokens, position p) with π_ref, H, Σπ²
and the statistics a file names held at stated points; the entropy's own gradient channel; and
every claim with its evidence.

The per-token gradient on a uniform batch is checked against autograd through the operation rows'
torch text and core.reductions' functions (the code core.codegen's plain path runs, with the
uniform batch's groups by index); the channels of H and π_ref against autograd through
CompiledLoss's plain path itself."""
import functools
import math
from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
import torch

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.numeric.sampling import numpy_fn
from openrlhf_drpo.core import CompiledLoss
from openrlhf_drpo.analysis.present.report import report, to_json
from dsl.ir import postorder
from dsl.levels import argument_level, levels
from openrlhf_drpo.core.reductions import NAMESPACE
from dsl.operations import OPS
from dsl.walks import constant_nodes, evaluate

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
    namespace.update(NAMESPACE)
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
    """w, and the reference terms' ∂ℓ_ref/∂log π where they are a channel of their own (else None)."""
    res = analyze(dsl.parse(text, "v3.dsl"), seq_len=length, group_size=G, batch_size=N, position=p,
                  held=dict(held), group=(1,) * G)
    ref = res.reference
    # where the objective builds its own advantage Â, w is against it: Â for the batch's A too
    hat = res.advantage["at"] if res.advantage else None
    return res.w, (_valued_formula(res, ref["grad"]) if ref and ref["own"] else None), hat


def _valued_formula(res, e):
    """A channel's formula (in the parameters' names) at the parameters' values, as a function of r, μ, A, q."""
    values = {s: sp.nsimplify(res.params[s.name]) for s in e.free_symbols if s.name in res.params}
    names = {s.name: s for s in e.free_symbols}
    args = [names.get(k, sp.Symbol(k)) for k in ("r", "mu", "A", "q")]
    return numpy_fn(args, e.subs(values))


@pytest.mark.parametrize("text, held, by_position", UNIFORM, ids=[t[0].split("\n")[-1][:40] for t in UNIFORM])
@pytest.mark.parametrize("logp, A", [(-1.1, 0.7), (-0.95, -1.6), (-1.5, 2.5)])
def test_on_a_uniform_batch_each_tokens_gradient_is_the_derived_weight(text, held, by_position, logp, A):
    """autograd's ∂loss/∂log π at every unmasked token is (w·r·A + ∂ℓ_ref/∂log π)/n (the token mean
    over n tokens; the reference terms' part where they are a channel of their own),
    w from the analysis at the batch's own G, N, |y| and p: log r = 0.2 (inside a 0.8–1.2 clip),
    0.35 (beyond 1.2 and beyond 1 ± 0.2·H) and −0.2, with A of either sign."""
    obj = dsl.parse(text, "v3.dsl")
    G, groups, length = 3, 2, 3
    t, m = uniform_batch(G, groups, length, logp=logp, A=A, H=float(held.get("H", 1)),
                         rho_ref=float(held.get("rho_ref", 1)))
    (grad, _) = gradients(obj, t, m)
    r, mu = math.exp(logp + 1.3), math.exp(-1.3)
    n = int(m.sum())
    for p in range(1, length + 1) if by_position else [length]:
        w, ref, hat = _weight(text, length, G, G * groups, p, tuple(sorted(held.items())))
        own = 0.0 if ref is None else float(np.asarray(ref(r, mu, A, float(held.get("rho_ref", 1)) / r)))
        a = A if hat is None else float(np.asarray(hat(A)))
        expected = (float(np.asarray(w(r, mu, a))) * r * a + own) / n
        at = grad[:-1, p - 1] if by_position else grad[m]
        assert torch.allclose(at, torch.full_like(at, expected), rtol=1e-9, atol=1e-15), (p, at, expected)
    assert torch.all(grad[~m] == 0)


# ---------------------------------------------------------------- the channels of H and π_ref
def at_tokens(e, **values):
    """The analysis's SymPy formula e at arrays of r, μ, A, H and q (the names it reads)."""
    names = {s.name: s for s in e.free_symbols}
    keys = [k for k in values if k in names]
    return np.asarray(numpy_fn([names[k] for k in keys], e)(*(values[k] for k in keys)), dtype=float) + 0 * values["r"]


def valued(obj, e):
    """A channel's formula, written in the parameters' names, at the file's values."""
    return e.subs({s: sp.nsimplify(obj.params[s.name]) for s in e.free_symbols if s.name in obj.params})


def random_tokens(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    mask = torch.arange(T)[None, :] < torch.tensor([7, 3, 5, 6])[:, None]
    return dict(logp=old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64), old=old,
                A=torch.randn(B, T, generator=g, dtype=torch.float64) * 2,
                ref=old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64),
                H=torch.rand(B, T, generator=g, dtype=torch.float64) * 3, mask=mask)


ENTROPY_FORMS = [ENTROPY_BONUS, ENTROPY_CLIP, "r*A*exp(-0.1*H) + 0.01*H - 0.05*(H - 1)^2"]


@pytest.mark.parametrize("text", ENTROPY_FORMS)
def test_the_entropy_channel_is_autograds_gradient_in_h_through_the_compiled_loss(text):
    """w_H(r, μ, A, H) at each unmasked token is −n·∂loss/∂H of CompiledLoss's plain path (the
    loss is minus the token mean of ℓ over n tokens) at random r, A and H: H stays a symbol in
    w_H, so one formula holds at every H."""
    obj = dsl.parse(text, "h.dsl")
    channel = analyze(obj).entropy
    assert channel["check"]["status"] == "confirmed" and channel["check"]["points"] == 64
    t = random_tokens()
    H = t["H"].clone().requires_grad_()
    loss, _ = CompiledLoss(obj, fused=False)(t["logp"], t["old"], t["A"], t["mask"], entropy=H)
    (grad,) = torch.autograd.grad(loss, H)
    m, n = t["mask"], int(t["mask"].sum())
    r, mu = torch.exp(t["logp"] - t["old"])[m].numpy(), torch.exp(t["old"])[m].numpy()
    expected = at_tokens(valued(obj, channel["w_H"]), r=r, mu=mu, A=t["A"][m].numpy(), H=t["H"][m].numpy())
    assert np.allclose(-n * grad[m].numpy(), expected, rtol=1e-9, atol=1e-12)
    assert torch.all(grad[~m] == 0)


# the objective, and ∂ℓ_ref/∂log π of the terms that read π_ref, in q = π_ref/π and β's name (β = 0.04)
PPO = "min(r*A, clip(r, 0.8, 1.2)*A)"
REFERENCE_FORMS = [
    (f"{PPO} - β*(π_ref/π - log(π_ref/π) - 1)", "-β * (π_ref / π - log(π_ref / π) - 1)", "beta*(q - 1)"),   # k3
    (f"{PPO} - β*log(π/π_ref)", "-β * log(π / π_ref)", "-beta"),                                         # k1
    (f"{PPO} - β/2*log(π/π_ref)^2", "-β / 2 * log(π / π_ref)^2", "beta*log(q)"),                         # k2
    ("r*A*(π_ref/π)^β", "r * A * (π_ref / π)^β", "-A*q**beta*r*(beta - 1)"),     # inside a product: the whole ℓ
]


@pytest.mark.parametrize("text, terms, grad", REFERENCE_FORMS)
def test_the_reference_terms_gradient_reads_in_pi_ref_over_pi_and_is_autograds(text, terms, grad):
    """The report names the terms that read π_ref and their ∂ℓ_ref/∂log π in q = π_ref/π (k3's
    β·(q − 1)); that formula is −n·∂loss/∂log π of CompiledLoss's plain path on those terms alone,
    at random π, μ, π_ref and A."""
    res = analyze(dsl.parse(f"β = 0.04\n{text}", "ref.dsl"))
    out = to_json(res)["reference"]
    assert (out["terms"], out["grad_log_pi"], out["check"]["status"]) == (terms, grad, "confirmed")
    assert f"    ∂ℓ_ref/∂log π = {to_json(res)['text']['reference']}" in report(res, width=None)
    t = random_tokens(1)
    logp = t["logp"].clone().requires_grad_()
    loss, _ = CompiledLoss(dsl.parse(f"β = 0.04\n{terms}", "terms.dsl"), fused=False)(
        logp, t["old"], t["A"], t["mask"], ref_log_probs=t["ref"])
    (g,) = torch.autograd.grad(loss, logp)
    m, n = t["mask"], int(t["mask"].sum())
    q, r = torch.exp(t["ref"] - t["logp"])[m].numpy(), torch.exp(t["logp"] - t["old"])[m].numpy()
    expected = at_tokens(valued(res, res.reference["grad"]), r=r, mu=torch.exp(t["old"])[m].numpy(),
                         A=t["A"][m].numpy(), q=q)
    assert np.allclose(-n * g[m].numpy(), expected, rtol=1e-9, atol=1e-12)


def test_a_channel_finite_differences_cannot_check_is_unconfirmed_not_confirmed():
    """exp(10⁴·H) is a finite double only for H < 0.07: too few of the sampled H ∈ [0, 5]."""
    res = analyze(dsl.parse("r*A + exp(10000*H)", "steep.dsl"))
    assert res.entropy["check"]["status"] == "unconfirmed" and res.entropy["check"]["points"] < 32
    assert "    (unconfirmed: central finite differences of ℓ in H" in report(res, width=None)
    assert "too few points where ℓ is a finite double)" in report(res, width=None)


TTB = "ε = 0.2\ness = sg(batch_sum(r)^2/(batch_count(r)*batch_sum(r^2)))\nmin(r*A, clip(r, 1 - ε*ess, 1 + ε*ess)*A)"
TTB_EPS = "ε = 0.2\ness = sg(batch_sum(r)^2/((batch_sum(r^2) + 1e-8)*batch_count(r)))\nmin(r*A, clip(r, 1 - ε*ess, 1 + ε*ess)*A)"
# what the report says for each construct: the lines that matter, each as the report prints it
REPORT_LINES = [
    (ENTROPY_BONUS, {}, [
        "  locality   token: a token's loss reads the current policy at its own token only; a host may split the "
        "batch anywhere, even a response into chunks of tokens",
        "             - H = 1 nat (--set H=X), the entropy at the token",
        "  entropy channel  w_H = ∂ℓ/∂H, so that ∇ℓ = w·r·A·∇log π + w_H·∇H (H's own gradient, beside w's)",
        "    w_H = c"]),
    (K3, {}, [
        "             - π_ref = ρ_ref·μ, ρ_ref = π_ref/μ held at 1 (--set rho_ref=X): the reference terms read π_ref/π "
        "= ρ_ref/r",
        "  reference  the terms that read π_ref, -β * (π_ref / π - log(π_ref / π) - 1), are their own channel beside "
        "w·r·A, ∂ℓ_ref/∂log π (π_ref fixed), in q = π_ref/π",
        "    ∂ℓ_ref/∂log π = β·(q − 1)"]),
    (TTB, {}, [
        "  locality   batch: a token's loss reads the current policy across the whole optimizer batch (there under "
        "sg only: its gradient stays at its own token only); one loss call must hold the rank's whole optimizer "
        "batch (sums all-reduced across ranks)",
        "             - ess = sg(batch_sum(r)^2 / (batch_count(r) * batch_sum(r^2))) held as a parameter at 1 (its "
        "value on the uniform batch: 1; --set ess=X): no gradient passes through it",
        "    A > 0   r: 1.2    π: 6·μ/5    (reachable; w is 0 beyond it)"]),
    (TTB, {"ess": Fraction(1, 2)}, [       # the boundary moves with the held ESS: 1 + ε·ess
        "    A > 0   r: 1.1    π: 11·μ/10    (reachable; w is 0 beyond it)",
        "    A < 0   r: 0.9    π: 9·μ/10    (reachable; w is 0 beyond it)"]),
    (TTB_EPS, {}, [       # FeynRL's + 1e-8 makes the uniform batch's ESS move with r: held at r = 1, said so
        "             - ess = sg(batch_sum(r)^2 / ((batch_sum(r^2) + 1e-08) * batch_count(r))) held as a parameter at "
        "0.99999999875 (its value on the uniform batch at r = 1, where it moves with r: 0.99999999875; --set "
        "ess=X): no gradient passes through it"]),
]


@pytest.mark.parametrize("text, held, lines", REPORT_LINES,
                         ids=["entropy", "k3", "batch-ess", "batch-ess-held", "batch-ess-moving"])
def test_the_report_says_what_each_construct_is_analysed_as(text, held, lines):
    got = report(analyze(dsl.parse(text, "v3.dsl"), held=held), width=None).splitlines()
    assert [line for line in lines if line not in got] == []


@pytest.mark.parametrize("text, said", [
    (TTB, "w, its cases and its boundaries below are evaluated at the held ess = 1: numbers there, not functions "
          "of them"),
    (ENTROPY_CLIP, "w, its cases and its boundaries below are evaluated at the held H = 1"),
    ("β = 0.04\nr*A*(π_ref/π)^β", "w, its cases and its boundaries below are evaluated at the held ρ_ref = 1"),
])
def test_a_weight_that_reads_a_held_value_says_it_is_evaluated_there(text, said):
    assert said in to_json(analyze(dsl.parse(text, "v3.dsl")))["scope"]["exact"]


def test_a_weight_that_reads_no_held_value_does_not_say_so():
    assert "evaluated at the held" not in to_json(analyze(dsl.parse(ENTROPY_BONUS, "v3.dsl")))["scope"]["exact"]


def test_the_json_holds_both_channels_after_the_weight_and_only_where_read():
    out = to_json(analyze(dsl.parse(f"β = 0.04\n{PPO} + 0.01*H - β*log(π/π_ref)", "both.dsl")))
    keys = list(out)
    assert keys[keys.index("weight"):keys.index("cases") + 1] == ["weight", "entropy", "reference", "cases"]
    assert (out["entropy"]["w_H"], out["text"]["w_H"], out["reference"]["grad_log_pi"]) == ("1/100", "0.01", "-beta")
    assert out["symbols"] == ["r", "mu", "A", "beta", "rho_ref", "H", "q"]     # what its formulas read back over
    assert {"entropy", "reference"} & set(to_json(analyze(dsl.parse(PPO, "ppo.dsl")))) == set()


def test_a_reduction_over_the_whole_sum_makes_the_whole_objective_the_reference_term():
    """group_mean(a + b) is a + b on a group of equal responses: the view's terms are not the file's."""
    out = to_json(analyze(dsl.parse("β = 0.04\ngroup_mean(r*A - β*log(π/π_ref))", "gm.dsl"), group=(1,) * 8))
    assert (out["reference"]["terms"], out["reference"]["grad_log_pi"], out["reference"]["check"]["status"]) == (
        "group_mean(r * A - β * log(π / π_ref))", "A*r - beta", "confirmed")
    assert not out["reference"]["own_channel"]
