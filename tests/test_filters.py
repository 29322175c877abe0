"""[cond]·x where the condition fails (issue 36, item 1): the value is 0 and the gradient is 0, whatever
x holds there (NaN, ±inf, a reduction over a group of one or an empty group), and the branch min
and clip drop gives no gradient either, on the plain, the fused and the sync-free path, held to an independent float64 reference that never evaluates x
where the condition fails (it gathers the kept tokens first: no select, no generated code)."""
import math
import warnings

import pytest
import torch

import dsl
from openrlhf_drpo.core import CompiledLoss

F64 = torch.float64
PATHS = {"plain": dict(fused=False), "fused": dict(fused=True), "sync_free": dict(fused=True, sync_free=True)}


def build(text, path):
    loss_fn = CompiledLoss(dsl.parse(text), fused=PATHS[path]["fused"])
    loss_fn.sync_free = PATHS[path].get("sync_free", False)
    return loss_fn


def ratio(logp, old):
    return torch.exp(torch.clamp(logp - old, -20, 20))


def token_mean(per_token, mask):
    """−Σ ℓ over the kept tokens / the unmasked tokens (token-mean, as every case here aggregates)."""
    return -sum(x.sum() for x in per_token) / mask.sum()


# ---------------------------------------------------------------- the references, by hand
def dapo_reference(logp, old, A, mask, groups):
    """DAPO's dynamic-sampling filter: responses whose group's rewards all agree (std 0, or a group of
    one) are left out before anything is computed of them."""
    R = torch.stack([A[b][mask[b]].mean() for b in range(len(A))])
    out = []
    for g in groups.unique():
        members = [b for b in range(len(A)) if groups[b] == g and mask[b].any()]
        if len(members) < 2 or R[members].std() == 0:
            continue
        mean, std = R[members].mean(), R[members].std()
        for b in members:
            adv = (R[b] - mean) / std
            r = ratio(logp[b][mask[b]], old[b][mask[b]])
            out.append(torch.minimum(r * adv, torch.clamp(r, 0.8, 1.28) * adv).sum())
    return token_mean(out, mask)


def standardized_reference(logp, old, A, mask, groups):
    """[group_count(x) > 1]·A·(x − group_mean(x))/group_std(x), x = seq_mean(log π − log μ): a group
    of one (std 0: 0/0) and an empty response left out."""
    nonempty = [b for b in range(len(A)) if mask[b].any()]
    x = {b: (logp[b] - old[b])[mask[b]].mean() for b in nonempty}
    out = []
    for b in nonempty:
        mates = [c for c in nonempty if groups[c] == groups[b]]
        if len(mates) < 2:
            continue
        xs = torch.stack([x[c] for c in mates])
        out.append((A[b][mask[b]] * (x[b] - xs.mean()) / xs.std()).sum())
    return token_mean(out, mask)


def per_token_reference(keep, value):
    """A filter on each token: `value` of the gathered kept tokens only."""
    def reference(logp, old, A, mask, groups):
        k = keep(logp.detach(), old, A) & mask
        return token_mean([value(logp[k], old[k], A[k])], mask)
    return reference


def one_token_batch():
    """The issue's smallest case: three responses of two tokens, groups [0, 0, 1]."""
    A = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]], dtype=F64)
    old = torch.full((3, 2), -1.0, dtype=F64)
    logp = old + torch.tensor([[0.1, -0.2], [0.05, 0.3], [0.2, -0.1]], dtype=F64)
    return logp, old, A, torch.ones(3, 2, dtype=torch.bool), torch.tensor([0, 0, 1])


def mixed_batch():
    """Signed advantages of every size (log of a negative, exp overflow where a filter drops), a group
    of one (response 2), an empty response (3) alone in its group, a masked token."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(5, 4, generator=g, dtype=F64) * 2 - 0.1
    logp = old + 0.3 * torch.randn(5, 4, generator=g, dtype=F64)
    A = torch.tensor([[2.0, -1.0, 0.0, 7.0], [-3.0, 1.0, 6.0, -0.5], [1.0, -2.0, 0.5, 3.0],
                      [1.0, 1.0, 1.0, 1.0], [-1.0, 0.0, 2.0, 9.0]], dtype=F64)
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[3] = False
    mask[1, 3] = False
    return logp, old, A, mask, torch.tensor([0, 0, 1, 2, 0])


def overflow_batch():
    """mixed_batch with a log-ratio of +1000 at a token of A > 0: e^1000 is inf in float64."""
    logp, old, A, mask, groups = mixed_batch()
    logp[0, 0] = old[0, 0] + 1000
    return logp, old, A, mask, groups


def raw_ppo_reference(logp, old, A, mask, groups):
    """min(s·A, clip(s, 0.8, 1.2)·A), s = e^(log π − log μ): each token's chosen branch alone (the
    clipped one is chosen only out of the band, where it is constant)."""
    s = torch.exp(logp.detach() - old)
    first = (s * A <= torch.clamp(s, 0.8, 1.2) * A) & mask
    second = ~first & mask
    return token_mean([torch.exp(logp[first] - old[first]) * A[first], torch.clamp(s[second], 0.8, 1.2) * A[second]],
                      mask)


DAPO = """R = seq_mean(A)
s = group_std(R)
Â = (R - group_mean(R))/s
[s > 0]*min(r*Â, clip(r, 0.8, 1.28)*Â)
"""
CASES = {
    "dapo_filter": (DAPO, one_token_batch, dapo_reference),
    "dapo_filter_mixed": (DAPO, mixed_batch, dapo_reference),
    "group_of_one_standardized": ("x = seq_mean(log(π) - log(μ))\n"
                                  "[group_count(x) > 1]*A*(x - group_mean(x))/group_std(x)",
                                  mixed_batch, standardized_reference),
    "log_of_negative_all_dropped": ("[A > 5]*(r*log(-A))", one_token_batch,
                                    per_token_reference(lambda lp, o, A: A > 5,
                                                        lambda lp, o, A: ratio(lp, o) * torch.log(-A))),
    "log_of_negative_dropped": ("[A < 0]*(r*log(-A))", mixed_batch,
                                per_token_reference(lambda lp, o, A: A < 0, lambda lp, o, A: ratio(lp, o) * torch.log(-A))),
    "nan_factor_after_the_filter": ("[A > 0]*2*(r*log(A))", mixed_batch,
                                    per_token_reference(lambda lp, o, A: A > 0,
                                                        lambda lp, o, A: 2 * (ratio(lp, o) * torch.log(A)))),
    "negated_filter": ("-[A > 0]*(r*log(A))", mixed_batch,
                       per_token_reference(lambda lp, o, A: A > 0, lambda lp, o, A: -(ratio(lp, o) * torch.log(A)))),
    "infinite_where_dropped": ("[A > 0]*(r*exp(-1000*A))", mixed_batch,
                               per_token_reference(lambda lp, o, A: A > 0,
                                                   lambda lp, o, A: ratio(lp, o) * torch.exp(-1000 * A))),
    "quotient_by_zero_dropped": ("[A != 0]*(r/A)", mixed_batch,
                                 per_token_reference(lambda lp, o, A: A != 0, lambda lp, o, A: ratio(lp, o) / A)),
    # min and clip select a branch too: the dropped one's derivative is inf here
    "min_drops_an_overflowing_branch": ("s = exp(log(π) - log(μ))\nmin(s*A, clip(s, 0.8, 1.2)*A)", overflow_batch,
                                        raw_ppo_reference),
    # a condition on π (a boundary), x NaN past it: the same selection
    "boundary_on_r": ("[r < 1]*A*sqrt(1 - r)", mixed_batch,
                      per_token_reference(lambda lp, o, A: ratio(lp, o) < 1,
                                          lambda lp, o, A: A * torch.sqrt(1 - ratio(lp, o)))),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_a_failed_condition_gives_value_0_and_gradient_0_on_every_path(case, path):
    text, make, reference = CASES[case]
    logp, old, A, mask, groups = make()
    lp = logp.clone().requires_grad_()
    loss, metrics = build(text, path)(lp, old, A, mask, groups=groups if "group" in text else None)
    grad, = torch.autograd.grad(loss, lp)
    ref_lp = logp.clone().requires_grad_()
    ref = reference(ref_lp, old, A, mask, groups)
    ref_grad, = torch.autograd.grad(ref, ref_lp, allow_unused=True)
    ref_grad = torch.zeros_like(logp) if ref_grad is None else ref_grad
    assert torch.isfinite(grad).all(), grad
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert all(math.isfinite(v) for v in metrics.floats().values()), metrics


@pytest.mark.parametrize("path", PATHS)
def test_the_dapo_filter_drops_the_lone_response_gradient_and_all(path):
    logp, old, A, mask, groups = one_token_batch()
    lp = logp.clone().requires_grad_()
    loss, _ = build(DAPO, path)(lp, old, A, mask, groups=groups)
    grad, = torch.autograd.grad(loss, lp)
    assert grad[2].tolist() == [0.0, 0.0] and grad[:2].abs().min() > 0


def test_a_chain_of_mins_over_its_own_bindings_compiles_and_its_paths_agree():
    """b_{i+1} = min(b_i, 2·b_i − 1), 24 deep: each b_i sits in both branches of the next min, so
    guarding every copy by all the conditions above it would take 2^24 copies (guard_selects' budget
    falls back to the nearest condition)."""
    text = "\n".join(["b0 = r*A"] + [f"b{i + 1} = min(b{i}, 2*b{i} - 1)" for i in range(24)] + ["b24"])
    logp, old, A, mask, _ = mixed_batch()
    out = []
    for path in PATHS:
        lp = logp.clone().requires_grad_()
        loss, _ = build(text, path)(lp, old, A, mask)
        out.append((loss.detach(), torch.autograd.grad(loss, lp)[0]))
    for loss, grad in out[1:]:
        torch.testing.assert_close(loss, out[0][0], rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, out[0][1], rtol=1e-12, atol=0)


def test_a_filter_over_a_chain_past_the_guard_budget_is_said_not_silent():
    """Past guard_selects' budget a branch is guarded by its nearest condition only, which no longer
    keeps [A > 0]'s dropped log(A) = NaN out of the plain path's gradient: the construction says so,
    and within the budget (6 deep) it stays silent and exact."""
    deep = lambda n: "\n".join(["b0 = r*log(A)"] + [f"b{i + 1} = min(b{i}, 2*b{i} - 1)" for i in range(n)]  # noqa: E731
                               + [f"[A > 0]*b{n}"])
    with pytest.warns(UserWarning, match="too deeply for every branch to be guarded"):
        CompiledLoss(dsl.parse(deep(7), "deep.dsl"), fused=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompiledLoss(dsl.parse(deep(6), "deep.dsl"), fused=False)
