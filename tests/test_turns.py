"""The language's fourth version, turns (issue 38, item 2): a response holding several turns of a
multi-turn agent episode, separated by tool or environment tokens the mask drops. turn_sum(x),
turn_mean(x) and turn_len reduce over the current turn's unmasked tokens (the tokens of its response
with its turn id); the hosts give the turn ids or refuse, naming what gives them. The reduction rows
themselves are also held to autograd of their definition by tests/test_reductions.py (generated)."""
import math
import types

import pytest
import torch

import dsl
from openrlhf_drpo.core import CompiledLoss, turn_ids

F64 = torch.float64
# ids any integers, a turn split by another's tokens, masked tool tokens between turns, masked tokens
# holding an unmasked turn's id (TRL pads its tool_mask with 1: padding shares the last turn's), an empty response
TURNS = [[0, 0, 0, -1, -1, 1, 1, 1], [4, 4, 9, 9, 4, 4, 4, 9], [0, 0, 0, 0, 0, 0, 0, 0], [3, 3, 1, 1, 1, 0, 0, 0],
         [0, 0, 2, 3, 4, 5, 6, 7], [5, 5, 5, 5, 5, 5, 6, 6]]
MASK = [[1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(MASK, dtype=torch.bool)
    old = -torch.rand(mask.shape, generator=g, dtype=F64) * 2 - 0.05
    new = old + 2e-4 * torch.randn(mask.shape, generator=g, dtype=F64)     # around GSPO's narrow clip
    A = torch.randn(mask.shape[0], 1, generator=g, dtype=F64).expand(mask.shape).clone()
    return new, old, A, mask, torch.tensor(TURNS)


def dirty(x, mask):
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype).repeat(x.numel() // 3 + 1)
    return torch.where(mask, x, junk[: x.numel()].view_as(x))


def gspo_turn_reference(new, old, A, mask, turns, lo=3e-4, hi=4e-4):
    """Per-turn GSPO by loops over responses and their turn ids, in float64: each turn's ratio the
    exponential of the mean log-ratio over its unmasked tokens, min(s·A, clip(s)·A) at each of them,
    seq-mean-token-mean (each non-empty response's token sum over its length + 1e-8, as OpenRLHF's
    aggregate_loss, averaged over those responses)."""
    new = new.clone().requires_grad_()
    per_response = []
    for b in range(new.shape[0]):
        kept = [t for t in range(new.shape[1]) if mask[b, t]]
        if not kept:
            continue
        terms = []
        for t in kept:
            mates = [u for u in kept if turns[b, u] == turns[b, t]]
            s = torch.exp(sum(new[b, u] - old[b, u] for u in mates) / len(mates))
            terms.append(torch.minimum(s * A[b, t], torch.clamp(s, 1 - lo, 1 + hi) * A[b, t]))
        per_response.append(sum(terms) / (len(terms) + 1e-8))
    loss = -sum(per_response) / len(per_response)
    return loss.detach(), torch.autograd.grad(loss, new)[0]


@pytest.mark.parametrize("fused, sync_free", [(False, False), (True, False), (True, True)],
                         ids=["plain", "fused", "sync-free"])
def test_per_turn_gspo_equals_an_independent_float64_loop_reference_on_every_path(fused, sync_free):
    new, old, A, mask, turns = batch()
    want_loss, want_grad = gspo_turn_reference(new, old, A, mask, turns)
    loss_fn = CompiledLoss("gspo_turn", fused=fused)
    loss_fn.sync_free = sync_free
    for clean in (True, False):       # NaN and ±inf in every masked slot change nothing
        fix = (lambda x: x) if clean else (lambda x: dirty(x, mask))     # noqa: E731
        lp = fix(new).requires_grad_()
        loss, _ = loss_fn(lp, fix(old), fix(A), mask, turns=turns)
        grad, = torch.autograd.grad(loss, lp)
        assert torch.allclose(loss, want_loss, rtol=1e-12, atol=0), (loss, want_loss)
        assert torch.allclose(torch.where(mask, grad, 0.0), want_grad, rtol=1e-10, atol=1e-15)
        assert not grad[~mask].any()


def test_per_turn_gspo_is_gspo_where_each_response_is_one_turn():
    new, old, A, mask, _ = batch(1)
    one = torch.zeros_like(mask, dtype=torch.long)
    got = CompiledLoss("gspo_turn")(new, old, A, mask, turns=one).loss
    assert torch.allclose(got, CompiledLoss("gspo")(new, old, A, mask).loss, rtol=1e-14, atol=0)
    # and differs once the turns do (the check can fail)
    assert not torch.allclose(CompiledLoss("gspo_turn")(new, old, A, mask, turns=batch()[4]).loss, got,
                              rtol=1e-14, atol=0)


@pytest.mark.parametrize("text, level, locality, kept_whole", [
    ("r*A*turn_mean(r)", "token", "response", ()),
    ("r*A*turn_sum(r)/turn_len", "token", "response", ()),
    ("r*A*turn_len", "token", "token", ()),
    ("r*(A - group_mean(turn_mean(seq_mean(A))))", "token", "token", ("groups",)),
    ("r*A - batch_mean(turn_sum(r))", "token", "batch", ("batch",)),
    ("seq_mean(turn_mean(r)*A)", "response", "response", ()),
    ("turn_sum(seq_mean(r))*seq_mean(A)", "token", "response", ()),     # a response value summed over a turn
])
def test_a_turn_reduction_is_token_level_and_reads_no_more_than_its_response(text, level, locality, kept_whole):
    """A turn's value is held along the turn, not the response: token-level, as a prefix's (dsl.levels),
    and its width is the response's (it reads only its own response)."""
    obj = dsl.parse(text)
    assert obj.facts.level[obj.expr] == level
    assert obj.locality() == locality and obj.facts.kept_whole == kept_whole
    assert obj.facts.third_version


def test_a_group_reduction_of_a_turn_mean_of_A_is_by_position_and_warned_of():
    """turn_mean(A) is A (A is one value per response): a group mean of it is position by position."""
    with pytest.warns(UserWarning, match="position by position"):
        CompiledLoss(dsl.parse("r*(A - group_mean(turn_mean(A)))"))


@pytest.mark.parametrize("mask, want", [
    ([[1, 1, 0, 0, 1, 1, 0, 1]], [[0, 0, 1, 1, 1, 1, 2, 2]]),      # two tool runs: three turns
    ([[0, 0, 1, 1, 1, 0, 0, 0]], [[0, 0, 0, 0, 0, 1, 1, 1]]),      # a prompt before, padding after: one turn
    ([[1, 1, 1, 1]], [[0, 0, 0, 0]]),
    ([[0, 0, 0]], [[0, 0, 0]]),
])
def test_turn_ids_count_the_runs_of_environment_tokens_before_a_token(mask, want):
    assert turn_ids(torch.tensor(mask)).tolist() == want
    assert turn_ids(torch.tensor(mask, dtype=torch.bool)).tolist() == want


@pytest.mark.parametrize("turns, message", [
    (None, r"objective 'gspo_turn' uses turn_mean \(each token's turn id within its response\), but no turn ids "
           r"were given \(turns=, one per token\)"),
    (torch.zeros(6, dtype=torch.long), r"CompiledLoss: turns is \[6\], log_probs \[6, 8\]: pass one turn id per token, a \[6, 8\] "
                                       r"tensor \(a response's tokens of one turn share an id\)"),
    (torch.zeros(6, 8), r"CompiledLoss: turns is torch.float32: pass integer turn ids \(turns.long\(\)\)"),
    ([[0] * 8] * 6, r"CompiledLoss: turns must be a torch.Tensor of turn ids \[6, 8\], got list"),
])
def test_turn_ids_are_checked_at_the_tensor_boundary_naming_tensor_shape_and_fix(turns, message):
    new, old, A, mask, _ = batch()
    with pytest.raises(ValueError, match=rf"^{message}"):
        CompiledLoss("gspo_turn")(new, old, A, mask, turns=turns)


def test_objectives_without_turns_ignore_turn_ids_given():
    new, old, A, mask, turns = batch()
    assert torch.equal(CompiledLoss("gspo")(new, old, A, mask, turns=turns).loss, CompiledLoss("gspo")(new, old, A,
                                                                                                       mask).loss)


def test_verl_refuses_turns_naming_why_in_its_terms():
    from test_verl import verl_python      # verl runs in its own venv
    proc = verl_python("from openrlhf_drpo.hosts.verl import VerlObjectiveLoss\nVerlObjectiveLoss('gspo_turn')")
    assert ("ValueError: objective 'gspo_turn' uses turn_mean (each token's turn id within its response), but verl "
            "gives a policy loss response_mask alone, no turn ids") in proc.stderr, proc.stderr


def test_trl_gives_turn_ids_from_its_tool_mask_and_one_turn_without_tools():
    from openrlhf_drpo.hosts.trl import TrlObjectiveLoss, _turns_and_staleness
    loss = TrlObjectiveLoss("gspo_turn")        # not refused: TRL provides them
    mask = torch.ones(2, 5, dtype=torch.long)
    tool = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]])
    assert _turns_and_staleness(loss.inputs(), {"tool_mask": tool}, mask)["turns"].tolist() == [[0, 0, 1, 1, 1],
                                                                                                [0, 0, 0, 0, 0]]
    assert not _turns_and_staleness(loss.inputs(), {}, mask)["turns"].any()


def test_drpo_train_gives_turn_ids_from_the_experiences_action_mask():
    from openrlhf_drpo.hosts.openrlhf.inputs import supplied
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    loss = ObjectiveLoss("gspo_turn")
    experience = types.SimpleNamespace(action_mask=torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool))
    trainer = types.SimpleNamespace(actor=types.SimpleNamespace(), args=None)
    with supplied(loss, trainer, experience):
        assert loss.given["turns"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert loss.given == {}
    with pytest.raises(ValueError, match=r"no turn ids were given \(turns=, one per token\): drpo-train gives it"):
        loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), action_mask=experience.action_mask)


def test_the_analysis_holds_a_response_as_one_turn_and_says_so():
    from openrlhf_drpo.analysis import analyze
    res = analyze("gspo_turn")
    said = [h["text"] for h in res.scope["held"]]
    assert any(t.startswith("the response is one turn") and "turn_mean(x) = x" in t for t in said), said
    gspo = analyze("gspo")
    assert res.weight == gspo.weight      # one turn: GSPO's weight
