"""Every reduction row of the operation table (dsl.operations.OPS), generated from the
table as PyTorch's OpInfo generates its operator tests: a row added there is tested here without
being listed anywhere. For each row, small objectives reading it at a token-level and a
response-level argument (and H, through its own channel) are compiled both ways; the fused
gradient, from the row's adjoint rule, must equal the plain path's autograd, and both must equal
autograd of an independent float64 reference (the row's `over` and `reduce` read as a membership
of the elements each token reduces: no code shared with the loss), on batches with ties, empty
responses, empty groups and groups of one, with NaN and ±inf in the masked slots."""
import dataclasses
import functools
import math
import pathlib
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

import dsl
from openrlhf_drpo.core import Aggregation, CompiledLoss, reductions
from dsl.ir import Node
from dsl.operations import OPS, Op

F64 = torch.float64
ROWS = [k for k, op in OPS.items() if op.reduce and op.over != "vocab"]     # (vocabulary sums: tests/test_vocabulary.py)
LENGTHS = [0, 6, 4, 1, 5, 0, 3, 6, 2, 6]        # empty responses, a one-token one, unequal lengths
GROUPS = [0, 0, 1, 1, 1, 2, 3, 4, 4, 4]          # {empty, 6}, {4, 1, 5}, {empty} (an empty group), {3} alone
# turn ids: several turns, a turn split by another's tokens, a masked turn between two, ids any integers
TURNS = [[0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1], [3, 3, 3, 3, 3, 3], [0, 1, 2, 3, 4, 5], [7, 7, -1, 7, 9, 9],
         [0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1], [2, 2, 2, 1, 1, 1], [0, 0, 0, 0, 0, 0], [4, 4, 5, 5, 5, 4]]
NORM = 23.0
# Each objective with its reference: ℓ from red(x, level), the row's reduction by its definition.
TEMPLATES = {
    "r*A*{f}(r)": lambda red, v: v.r * v.A * red(v.r, "token"),
    "r*A*{f}(seq_mean(r))": lambda red, v: v.r * v.A * red(v.seq_mean(v.r), "response"),
    "{f}(log(π))*A + 0.1*r*{f}(H)": lambda red, v: red(v.logp, "token") * v.A + 0.1 * v.r * red(v.H, "token"),
}


def batch(ties: bool, seed: int = 0):
    """Inputs in [10, 6], masked as LENGTHS say (a hole in one response). With `ties`, log-ratios,
    log π and H on a grid of eighths, exact in doubles: many tokens of a response, positions of a
    group and whole responses are equal (an extreme shared, a group with no spread)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    mask[7, 1] = False                                  # "unmasked" is not "before the end"
    if ties:
        old = -torch.randint(1, 12, (B, T), generator=g).to(F64) / 8
        old[3:5] = old[2]                               # equal responses in a group
        new = old + torch.randint(-2, 3, (B, T), generator=g).to(F64) / 8
        H = torch.randint(0, 3, (B, T), generator=g).to(F64) / 8
    else:
        old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
        new = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
        H = torch.rand(B, T, generator=g, dtype=F64)
    return dict(new=new, old=old, H=H, A=torch.randn(B, T, generator=g, dtype=F64), mask=mask,
                weights=torch.rand(B, T, generator=g, dtype=F64) + 0.5, groups=torch.tensor(GROUPS),
                turns=torch.tensor(TURNS))


def dirty(x, mask):
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype).repeat(x.numel() // 3 + 1)
    return torch.where(mask, x, junk[: x.numel()].view_as(x))


# ---------------------------------------------------------------- the reference, by definition
def members(over, level, mask, groups, turns=None):
    """[B, T, K]: which elements position (b, t) reduces: tokens (K = B·T) of its response, of its
    prefix or suffix, of its turn, of its group at its position, of the batch; or, for a response-level argument
    of a group or batch reduction, the non-empty responses (K = B) of its group or the batch."""
    B, T = mask.shape
    b, t = torch.arange(B).view(B, 1, 1, 1), torch.arange(T).view(1, T, 1, 1)
    c, s = torch.arange(B).view(1, 1, B, 1), torch.arange(T).view(1, 1, 1, T)
    mates = groups[b] == groups[c] if over == "group" else torch.ones(B, 1, B, 1, dtype=torch.bool)
    if level == "response" and over in ("group", "batch"):
        return (mates & mask.any(-1).view(1, 1, B, 1))[..., 0].expand(B, T, B)
    within = {"response": b == c, "prefix": (b == c) & (s <= t), "suffix": (b == c) & (s >= t),
              "turn": (b == c) & (turns[b, t] == turns[c, s]) if turns is not None else None,
              "group": mates & (s == t), "batch": mates}[over]
    return (within & mask[c, s]).expand(B, T, B, T).reshape(B, T, B * T)


Q = 0.3       # a constant argument's value (batch_quantile's q): test_operations.constant_args's


def _order(v, k, j):
    """The j-th smallest of the elements v where k holds, by its definition: the largest element with at
    most j others below it (ties share its gradient, torch.amax's); j [..] per position."""
    below = ((v[..., None, :] < v[..., :, None]) & k[..., None, :]).sum(-1)
    top = torch.where(k & (below <= j[..., None]), v, -math.inf).amax(-1)
    return torch.where(k.any(-1), top, 0.0)


def _kind(kind, v, k):
    """The kind's value over the elements v where k holds (0 over none), ties sharing an extreme's
    gradient (torch.amax's), the sample std (ddof = 1) 0 below two elements or where all are equal;
    the Q-quantile linear between its neighbours (torch.quantile's), f = Q·(n − 1) − ⌊Q·(n − 1)⌋."""
    n = k.sum(-1).to(v.dtype)
    rank = Q * (n - 1).clamp(min=0)
    frac = rank - rank.floor()
    if kind in ("quantile", "qlow", "qhigh", "qfrac"):
        low, high = _order(v, k, rank.floor()), _order(v, k, rank.ceil())
        return {"quantile": low + frac * (high - low), "qlow": low, "qhigh": high, "qfrac": frac}[kind]
    total = torch.where(k, v, 0.0).sum(-1)
    mean = total / n.clamp(min=1)
    if kind in ("max", "min"):
        pick = torch.amax if kind == "max" else torch.amin
        top = pick(torch.where(k, v, -math.inf if kind == "max" else math.inf), -1)
        return torch.where(n > 0, top, 0.0)
    if kind == "std":
        var = torch.where(k, (v - mean[..., None]) ** 2, 0.0).sum(-1) / (n - 1).clamp(min=1)
        spread = (n >= 2) & (var > 0)
        return torch.where(spread, torch.where(spread, var, 1.0).sqrt(), 0.0)
    return {"sum": total, "mean": mean, "count": n}[kind]


def reference_loss(name, template, b):
    """(loss, ∂/∂log π, ∂/∂H) by autograd of the definition: loss = −Σ mask·weights·ℓ / NORM."""
    op, mask = OPS[name], b["mask"]
    logp, H = b["new"].clone().requires_grad_(), b["H"].clone().requires_grad_()

    def seq_mean(x):
        return (torch.where(mask, x, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(x)

    def red(x, level):
        B, T = x.shape
        k = members(op.over, level, mask, b["groups"], b["turns"])
        values = (seq_mean(x)[:, 0] if level == "response" and op.over in ("group", "batch") else x.reshape(-1))
        return _kind(op.reduce, values.expand(B, T, -1), k)

    v = SimpleNamespace(r=torch.exp(logp - b["old"]), A=b["A"], logp=logp, H=H, seq_mean=seq_mean)
    ell = TEMPLATES[template](red, v)
    loss = -torch.where(mask, b["weights"] * ell, 0.0).sum() / NORM
    return (loss.detach(), *torch.autograd.grad(loss, [logp, H], allow_unused=True))


# ---------------------------------------------------------------- the loss under test
def objective(name, template):
    """The template with the row: parsed where a user may call it; an internal row (suffix_sum)
    swapped into the IR parsed with a callable reduction in its place."""
    constants = tuple(Node("num", value=Fraction(str(Q))) for _ in OPS[name].constants)
    stand_in = next(k for k in ROWS if OPS[k].callable and OPS[k].over not in ("group", "batch"))
    obj = dsl.parse(template.format(f=name if OPS[name].callable and not constants else stand_in))
    memo = {}

    def swap(n):        # (a row with a constant argument, as batch_quantile(x, q), takes Q)
        if n not in memo:
            ours = n.op == stand_in
            memo[n] = Node(name if ours else n.op, tuple(map(swap, n.args)) + constants * ours, n.value, n.pos)
        return memo[n]
    if OPS[name].callable and not constants:
        return obj
    return dataclasses.replace(obj, expr=swap(obj.expr))


def run(loss_fn, b, clean=True):
    fix = (lambda x: x) if clean else (lambda x: dirty(x, b["mask"]))     # noqa: E731
    lp, h = fix(b["new"]).requires_grad_(), fix(b["H"]).requires_grad_()
    loss, _ = loss_fn(lp, fix(b["old"]), fix(b["A"]), b["mask"], entropy=h, groups=b["groups"], turns=b["turns"],
                      aggregation=Aggregation(norm=NORM, weights=b["weights"]))
    return (loss.detach(), *torch.autograd.grad(loss, [lp, h], allow_unused=True))


def close(got, want, what):
    """got equals want; where one is None (H unread: autograd gives no ∂/∂H), the other is None or zero:
    a loss that drops the H channel (None) where the reference has a gradient fails."""
    if want is None or got is None:
        other = want if got is None else got
        assert other is None or not other.any(), what
        return
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-13), (what, (got - want).abs().max().item())


def fused_plain_reference(name, template, ties):
    """The row's check: fused (eager and sync-free) == plain == the reference, in the loss and both
    gradients, on a clean batch; the same bits with NaN and ±inf in every masked slot; masked tokens get nothing."""
    b = batch(ties)
    want = reference_loss(name, template, b)
    obj = objective(name, template)
    for fused, sync_free in ((True, False), (True, True), (False, False)):     # sync_free: CUDA's path
        loss_fn = CompiledLoss(obj, fused=fused)
        loss_fn.sync_free = sync_free
        got = run(loss_fn, b)
        for i, what in enumerate(("loss", "∂/∂log π", "∂/∂H")):
            close(got[i], want[i], f"{name} {template} fused={fused} sync_free={sync_free} ties={ties}: {what}")
        assert not got[1][~b["mask"]].any()
        messy = run(loss_fn, b, clean=False)
        assert all(torch.equal(x, y) for x, y in zip(got, messy) if x is not None), "masked NaN reached the loss"


@pytest.mark.parametrize("ties", [False, True], ids=["generic", "ties"])
@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("name", ROWS)
def test_each_reductions_fused_gradient_equals_plain_autograd_and_its_definitions(name, template, ties):
    fused_plain_reference(name, template, ties)


def test_the_check_fails_a_loss_that_returns_no_entropy_gradient_where_the_reference_has_one(monkeypatch):
    """close() passed whenever the loss returned no ∂/∂H (None), whatever the reference's was: here the
    loss's ∂/∂H is dropped on a row and template that read H, and the row's check must fail."""
    template = "{f}(log(π))*A + 0.1*r*{f}(H)"
    want = reference_loss("seq_sum", template, batch(False))[2]
    assert want is not None and want.any()
    with pytest.raises(AssertionError, match="∂/∂H"):
        close(None, want, "∂/∂H")
    honest = run
    monkeypatch.setattr(sys.modules[__name__], "run", lambda loss_fn, b, clean=True: honest(loss_fn, b, clean)[:2] + (None,))
    with pytest.raises(AssertionError, match="∂/∂H"):
        fused_plain_reference("seq_sum", template, False)


# ---------------------------------------------------------------- the rule is required, and checked
def test_a_reduction_row_without_an_adjoint_is_refused_where_it_is_built_naming_what_to_declare():
    """A contributor's group_max (a row as group_sum's, its lowering and kernel aside) without an
    adjoint: refused when the row is built, at import, before any loss could guess one."""
    fields = {f.name: getattr(OPS["group_sum"], f.name) for f in dataclasses.fields(Op)}
    with pytest.raises(TypeError, match=r"operation 'group_max': a reduction declares its adjoint=: a rule "
                                        r"\(node, its adjoint a, its argument x\)"):
        Op(**{**fields, "symbol": "group_max", "reduce": "max", "adjoint": None})
    with pytest.raises(TypeError, match="operation 'exp': only a reduction has an adjoint"):
        Op(**{**{f.name: getattr(OPS["exp"], f.name) for f in dataclasses.fields(Op)}, "adjoint": "none"})


def test_a_reduction_row_without_its_torch_function_is_refused_when_core_reductions_is_imported(monkeypatch):
    """A row's function lives in core.reductions under the row's name: one missing is an error when
    that module is imported (as codegen's KERNELS), never a NameError in a generated module's first call."""
    monkeypatch.setitem(OPS, "seq_toy", dataclasses.replace(OPS["seq_sum"], symbol="seq_toy"))
    path = pathlib.Path(reductions.__file__)
    with pytest.raises(TypeError, match=r"a function for every reduction row, of its name: missing \['seq_toy'\]"):
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), {"__name__": "reductions_copy"})


@pytest.mark.parametrize("name, wrong", [
    ("group_mean", "group_std"),    # the rule reverse mode used to guess for a kind it did not know
    ("seq_max", "seq_mean"),        # the maximum's gradient spread over every token
    ("seq_min", "seq_max"),         # ties taken as ≥ the minimum: every token
    ("batch_mean", "batch_sum"),    # the mean's 1/n left out
    ("prefix_mean", "prefix_sum"),
    ("turn_mean", "seq_mean"),       # the response's mean where the turn's is meant
    ("turn_sum", "turn_mean"),
    ("group_max", "group_mean"),    # the maximum's gradient spread over the group
    ("group_min", "group_max"),
    ("batch_quantile", "batch_qlow"),   # all of it to the lower neighbour
    ("seq_quantile", "seq_qhigh"),      # all of it to the upper neighbour
    ("seq_quantile", "seq_mean"),       # the quantile's gradient spread over the response
])
def test_the_generated_check_fails_a_row_declaring_another_rows_adjoint(monkeypatch, name, wrong):
    monkeypatch.setitem(OPS, name, dataclasses.replace(OPS[name], adjoint=OPS[wrong].adjoint))
    with pytest.raises(AssertionError, match="fused=True"):
        for template in TEMPLATES:
            for ties in (False, True):
                fused_plain_reference(name, template, ties)
