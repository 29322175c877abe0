"""Issue 46: one gradient on every path, by construction. Each case the issue lists, on the plain path
(autograd of the generated expression), the fused eager one and the sync-free one (CUDA's, here on the
CPU), against a float64 reference written here from each objective's definition, per response and per
group (no code shared with the compiler): an order statistic of a response-level value (read from one
token, never rebuilt from its copies), a division that meets a masked or empty position, sign of a
selecting product, and an all-masked step whose global normalizer is 0."""
import math

import pytest
import torch

import dsl
from openrlhf_drpo.core import Aggregation, CompiledLoss

F64 = torch.float64
PATHS = {"plain": dict(fused=False), "fused": dict(fused=True), "sync_free": dict(fused=True, sync_free=True)}


def run(path, src, logp, old, A=1.0, mask=None, aggregation=None, **inputs):
    """(loss, ∂/∂log π[, ∂/∂H]) on `path`; H, where given, carries a gradient."""
    loss_fn = CompiledLoss(dsl.parse(src), fused=PATHS[path]["fused"])
    loss_fn.sync_free = PATHS[path].get("sync_free", False)
    lp = logp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    leaves = [lp] + ([inputs["entropy"]] if "entropy" in inputs else [])
    loss, _ = loss_fn(lp, old.expand_as(lp), torch.as_tensor(A, dtype=F64).expand_as(lp), mask,
                      aggregation=aggregation, **inputs)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def reference(ell, logp, mask, H=None):
    """(loss, ∂/∂log π[, ∂/∂H]) by autograd of −Σ_unmasked ℓ / #unmasked (token-mean), ℓ = ell(log π, H)
    written per response: each response's value computed once, as its definition says."""
    lp = logp.clone().requires_grad_()
    leaves = [lp] + ([H.detach().clone().requires_grad_()] if H is not None else [])
    per_token = ell(*leaves).expand_as(lp)
    loss = -torch.where(mask, per_token, 0.0).sum() / mask.sum().clamp(min=1)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def close(got, want, what):
    for g, w, name in zip(got, want, ("loss", "∂/∂log π", "∂/∂H")):
        assert torch.isfinite(g).all() and torch.allclose(g, w, rtol=1e-9, atol=1e-12), (what, name, g, w)


def group_pick(v, groups, pick):
    """Each response's group's largest (pick = torch.amax) or smallest value of v [B], as [B, 1]."""
    mates = groups[:, None] == groups[None, :]
    empty = -math.inf if pick is torch.amax else math.inf
    return pick(torch.where(mates, v[None, :], empty), -1)[:, None]


def seq_sum(x):
    return x.sum(-1)


def seq_mean(x):
    return x.mean(-1)


# ---------------------------------------------------------------- case 1
GROUPS = torch.tensor([0, 0, 1, 1])


def order_batch(seed):
    """4 responses of 3 unmasked tokens in two groups of two; each seed below was found (on the old
    code) to give response-level values whose copies sum, over n, to another double than each copy
    holds: the old Σ/n re-read, which the fused adjoint's exact tie test then missed."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 3, generator=g, dtype=F64) * 1.5 - 0.05
    return logp, logp.mean(-1, keepdim=True) + 0.3 * torch.randn(4, 1, generator=g, dtype=F64)


# each objective: (its seed, ℓ(log π, log μ) per its definition)
ORDER_STATISTICS = {
    "group_max(seq_sum(log(π)))": (8, lambda lp, old: group_pick(seq_sum(lp), GROUPS, torch.amax)),
    "r*A - group_max(exp(seq_mean(log(π) - log(μ))))":
        (0, lambda lp, old: torch.exp(lp - old) - group_pick(torch.exp(seq_mean(lp - old)), GROUPS, torch.amax)),
    "group_min(seq_mean(r)*2.7)": (2, lambda lp, old: group_pick(seq_mean(torch.exp(lp - old)) * 2.7, GROUPS, torch.amin)),
    "batch_quantile(seq_sum(log(π)), 0.3)": (0, lambda lp, old: torch.quantile(seq_sum(lp), 0.3)),
    "seq_max(group_max(log(seq_mean(π))))":
        (0, lambda lp, old: group_pick(torch.log(seq_mean(torch.exp(lp))), GROUPS, torch.amax)),
    "seq_quantile(group_min(sqrt(seq_sum(π))*0.3), 0.5)":
        (2, lambda lp, old: group_pick(torch.sqrt(seq_sum(torch.exp(lp))) * 0.3, GROUPS, torch.amin)),
}


@pytest.mark.parametrize("path", PATHS)
def test_an_order_statistic_of_one_response_keeps_its_gradient_on_every_path(path):
    """The issue's first case: one response in a group of one, log π = [−0.9, −0.1, −0.4]: every token
    reads Σ log π, so d loss/d log π = −1 on each (the loss is −the token mean of ℓ)."""
    logp, old = torch.tensor([[-0.9, -0.1, -0.4]], dtype=F64), torch.tensor([[-1.0]], dtype=F64)
    got = run(path, "group_max(seq_sum(log(π)))", logp, old, groups=torch.tensor([0]))
    assert got[0].item() == pytest.approx(1.4) and torch.equal(got[1], torch.full((1, 3), -1.0, dtype=F64)), got


@pytest.mark.parametrize("path", PATHS)
def test_the_issues_second_order_statistic_gives_row_0_its_gradient_through_the_maximum(path):
    """groups [0, 0], 3 tokens each, log π = −1, log μ = [−1.2949, −1]: row 0 attains the maximum
    e^0.2949, which all 6 tokens read: its tokens get −(r − 6·e^0.2949/3)/6 = +0.2238, not −0.2238."""
    old = torch.tensor([[-1.2949], [-1.0]], dtype=F64)
    got = run(path, "r*A - group_max(exp(seq_mean(log(π) - log(μ))))", torch.full((2, 3), -1.0, dtype=F64), old,
              groups=torch.tensor([0, 0]))
    e = math.exp(0.2949)
    assert got[1][0].tolist() == pytest.approx([(2 * e - e) / 6] * 3, abs=1e-12), got[1]
    assert got[1][1].tolist() == pytest.approx([-1 / 6] * 3, abs=1e-12), got[1]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("src", ORDER_STATISTICS)
def test_an_order_statistic_of_response_level_values_passes_the_gradient_of_the_one_it_picks(src, path):
    seed, ell = ORDER_STATISTICS[src]
    logp, old = order_batch(seed)
    want = reference(lambda lp: ell(lp, old), logp, torch.ones_like(logp, dtype=torch.bool))
    close(run(path, src, logp, old, groups=GROUPS), want, src)


# ---------------------------------------------------------------- case 2
def _safe(num, den, mask):
    """num/den where the token is unmasked, 0 elsewhere, never dividing there (the reference's own double where)."""
    return torch.where(mask, num, 0.0) / torch.where(mask, den, 1.0)


LP2 = torch.tensor([[-0.5, -1.0, -0.7], [-0.3, -0.2, -0.9]], dtype=F64)
OLD2 = torch.tensor([[-0.6]], dtype=F64)
SPQ = torch.tensor([[0.5, 0.7, 0.9], [0.6, 0.8, 0.4]], dtype=F64)      # finite Σπ² in every slot, masked ones too
H2 = torch.tensor([[0.3, 0.2, 0.5], [0.1, 0.4, 0.6]], dtype=F64)
M = lambda rows: torch.tensor(rows, dtype=torch.bool)      # noqa: E731
# each division: (its mask, its inputs, ℓ(log π, H) by its definition, over the unmasked tokens only)
DIVISIONS = {
    "seq_mean(π)/sum_π_sq": (M([[1, 0, 0], [1, 1, 1]]), dict(sum_pi_sq=SPQ),
                             lambda lp, m: _safe(_mean(torch.exp(lp), m), SPQ, m)),
    "batch_mean(π)/seq_len": (M([[1, 1, 1], [0, 0, 0]]), {},        # an empty response
                              lambda lp, m: _safe(torch.exp(lp)[m].mean(), m.sum(-1, keepdim=True).to(F64), m)),
    "seq_sum(r)/turn_len": (M([[1, 1, 0], [1, 1, 1]]), dict(turns=torch.tensor([[0, 0, 1], [0, 0, 1]])),   # a masked turn
                            lambda lp, m: _safe(_sum(torch.exp(lp - OLD2), m), torch.tensor([[2., 2, 1], [2, 2, 1]]), m)),
    "seq_sum(r)/prefix_sum(1)": (M([[0, 1, 1], [1, 1, 1]]), {},       # prefix_sum(1) is 0 before the first token
                                 lambda lp, m: _safe(_sum(torch.exp(lp - OLD2), m), m.to(F64).cumsum(-1), m)),
    "batch_mean(r)/group_count(r)": (M([[1, 1, 1], [0, 0, 0]]), dict(groups=torch.tensor([0, 1])),   # an empty group
                                     lambda lp, m: _safe(torch.exp(lp - OLD2)[m].mean(), torch.tensor([[1.], [0.]]), m)),
    "r*A + seq_mean(H)/sum_π_sq": (M([[1, 0, 0], [1, 1, 1]]), dict(sum_pi_sq=SPQ),        # d/dH
                                   lambda lp, m, H: torch.exp(lp - OLD2) + _safe(_mean(H, m), SPQ, m)),
}


def _sum(x, m):
    return torch.where(m, x, 0.0).sum(-1, keepdim=True)


def _mean(x, m):
    return _sum(x, m) / m.sum(-1, keepdim=True).clamp(min=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("src", DIVISIONS)
def test_a_division_that_meets_a_masked_or_empty_position_gives_a_finite_gradient_equal_on_every_path(src, path):
    mask, inputs, ell = DIVISIONS[src]
    if "H" in src:
        H = H2.clone().requires_grad_()
        want = reference(lambda lp, h: ell(lp, mask, h), LP2, mask, H2)
        got = run(path, src, LP2, OLD2, mask=mask, entropy=H, **inputs)
    else:
        want, got = reference(lambda lp: ell(lp, mask), LP2, mask), run(path, src, LP2, OLD2, mask=mask, **inputs)
    close(got, want, src)


# ---------------------------------------------------------------- case 3
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("src", ["sign([π < 0.5]*sqrt(0.5 - π))*r", "|[π < 0.5]*sqrt(0.5 - π)|*r"])
def test_sign_or_abs_of_a_selecting_product_passes_no_nan_from_the_dropped_branch(src, path):
    """log π = [−0.5, −1.0], log μ = −0.6: π = 0.61 fails π < 0.5, where sqrt(0.5 − π) is NaN and the
    select gives 0, so ℓ = 0·r there, with gradient 0; π = 0.37 passes."""
    lp, old = torch.tensor([[-0.5, -1.0]], dtype=F64), torch.tensor([[-0.6]], dtype=F64)

    def ell(logp):
        pi, r = torch.exp(logp), torch.exp(logp - old)
        inside = torch.sqrt(torch.where(pi < 0.5, 0.5 - pi, 1.0))
        value = torch.where(pi < 0.5, inside, 0.0)
        return (torch.sign(value).detach() if src.startswith("sign") else value) * r
    close(run(path, src, lp, old), reference(ell, lp, torch.ones_like(lp, dtype=torch.bool)), src)


# ---------------------------------------------------------------- case 4
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("src", ["r*A", "seq_mean(log(π) - log(μ))*A", "min(r*A, clip(r, 0.8, 1.2)*A)/seq_len"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_an_all_masked_step_with_a_global_normalizer_of_0_gives_loss_0_and_gradient_0_on_every_path(src, mode, path):
    """norm = 0 is the step's token count where the step has no token: every path gives the plain
    path's 0 (the fused ones divided by the 0 itself, clamping only the local count: NaN)."""
    lp, old = torch.tensor([[-0.5, -1.0], [-0.2, -0.3]], dtype=F64), torch.tensor([[-0.6]], dtype=F64)
    loss, grad = run(path, src, lp, old, A=0.7, mask=torch.zeros(2, 2, dtype=torch.bool),
                     aggregation=Aggregation(mode=mode, norm=0.0))
    assert loss.item() == 0 and torch.equal(grad.abs(), torch.zeros_like(lp)), (loss, grad)
