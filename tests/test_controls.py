"""The language's fifth version in the loss core: `step` and controlled parameters (dsl.controls,
openrlhf_drpo.core.controls). Each rule is held to its source's code where it has code (OpenRLHF's
AdaptiveKLController), the statistic to the whole batch and to the independent float64 reference,
and the state to what a resumed or a second rank must see; each test fails with its feature broken."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import dsl
from dsl.controls import Control
from dsl.ir import Node
from openrlhf_drpo.core import CompiledLoss
from openrlhf_drpo.core import controls as core_controls

B, T = 6, 5
KL_FILE = """\
kl_target = 0.05
horizon = 50
β = 0.1
KL = batch_mean(log(π_old) - log(π_ref))
β ← β·(1 + clip(KL/kl_target - 1, -0.2, 0.2)·batch_count(seq_len)/horizon) in [0, 10]
min(r*A, clip(r, 0.8, 1.2)*A) - β·(log(π) - log(π_ref))
"""


def batch(seed: int, rows: int = B):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, T, generator=g, dtype=torch.float64) - 0.05
    old = logp + 0.05 * torch.randn(rows, T, generator=g, dtype=torch.float64)
    ref = logp - 0.1 * torch.rand(rows, T, generator=g, dtype=torch.float64)
    A = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, T).contiguous()
    mask = torch.ones(rows, T, dtype=torch.bool)
    mask[0, 2:] = False
    mask[-1, 4:] = False
    old[0, 3] = ref[0, 4] = math.nan            # masked slots: must never reach a statistic
    return logp, old, A, mask, ref


def train_call(loss, logp, old, A, mask, ref):
    out = loss(logp.detach().clone().requires_grad_(), old, A, mask, ref_log_probs=ref)
    out.loss.backward()
    return out.loss.item()


def kl_loss(**kw):
    return CompiledLoss(dsl.parse(KL_FILE, "kl.dsl"), **kw)


def sampled_kl(old, ref, mask):
    return (old - ref)[mask].mean().item()


# ---------------------------------------------------------------- the rule against its source's code
def test_adaptive_kl_follows_openrlhf_adaptive_kl_controller_step_by_step():
    from openrlhf.trainer.ppo_utils.kl_controller import AdaptiveKLController
    loss, oracle = CompiledLoss("adaptive_kl"), AdaptiveKLController(0.05, 6, 10000)
    for step, kl_shift in enumerate([0.0, 3.0, 9.0, 5.5, 30.0]):        # below, near and far above the target
        logp, old, A, mask, ref = batch(step)
        ref = ref - kl_shift
        train_call(loss, logp, old, A, mask, ref)
        logged = loss.end_step()
        # OpenRLHF's status["kl"]: each sample's masked token mean, averaged over the samples
        oracle.update(np.mean([(old - ref)[i][mask[i]].mean().item() for i in range(len(mask))]),
                      mask.any(-1).sum().item())
        assert logged["drpo_beta"] == oracle.value, (step, logged, oracle.value)
        assert logged["drpo_step"] == step + 1


def _miles_3222_update_as_its_description_states_it(coef, kl, target=0.1, horizon=10000, steps=1):
    # transcribed from the pull request's description (the code is not released): not our rule's code
    return max(coef * (1 + min(max(kl / target - 1, -0.2), 0.2) * steps / horizon), 0.0)


def test_kl_loss_ctrl_follows_miles_3222s_update_as_its_description_states_it():
    loss, coef = CompiledLoss("kl_loss_ctrl"), 0.001
    for step in range(4):
        logp, old, A, mask, ref = batch(10 + step)
        ref = ref - 0.3 * step
        train_call(loss, logp, old, A, mask, ref)
        q = (ref - logp).exp()
        k3 = (q - (ref - logp) - 1).clamp(-10, 10)[mask].mean().item()
        coef = _miles_3222_update_as_its_description_states_it(coef, k3)
        assert loss.end_step()["drpo_beta"] == pytest.approx(coef, rel=1e-13, abs=0)


def test_clip_schedule_reads_the_step_counter_as_baselines_ppo2_anneals_its_clip_range():
    loss = CompiledLoss("clip_schedule", total=4)
    seen = []
    for step in range(6):
        seen.append(float(loss.objective.params["eps"]) if "eps" in loss.objective.params else
                    dsl.walks.evaluate(loss.objective.bindings["eps"], {k: float(v) for k, v in loss.objective.params.items()}))
        assert loss.end_step() == {"drpo_step": step + 1}
    assert seen == [0.1 * max(1 - s / 4, 0) for s in range(6)]      # frac = 1 - (update - 1)/nupdates


# ---------------------------------------------------------------- the statistic: the step's whole batch
@pytest.mark.parametrize("splits", [[6], [3, 3], [1, 2, 3], [2, 2, 2]])
def test_the_statistic_over_micro_batches_is_the_whole_batchs(splits):
    whole, parts = kl_loss(), kl_loss()
    data = batch(3)
    train_call(whole, *data)
    start = 0
    for n in splits:
        train_call(parts, *(x[start:start + n] for x in data))
        start += n
    assert parts.end_step()["drpo_beta"] == pytest.approx(whole.end_step()["drpo_beta"], rel=1e-14, abs=0)


def test_a_call_without_autograd_adds_nothing_to_the_steps_statistic():
    loss, alone = kl_loss(), kl_loss()
    logp, old, A, mask, ref = batch(4)
    with torch.no_grad():        # an evaluation, a batch-statistics recording pass
        loss(logp, old, A, mask, ref_log_probs=ref - 5.0)
    train_call(loss, logp, old, A, mask, ref)
    train_call(alone, logp, old, A, mask, ref)
    assert loss.end_step() == alone.end_step()


def test_the_update_comes_after_the_step_whose_loss_read_the_value_from_before_it():
    loss, fresh = kl_loss(), kl_loss()
    data = batch(5)
    first = train_call(loss, *data)
    assert first == train_call(fresh, *data)          # step 0: β = 0.1 on both
    beta = loss.end_step()["drpo_beta"]
    assert beta != 0.1
    at_new = kl_loss(**{"β": repr(beta)})
    assert train_call(loss, *data) == train_call(at_new, *data) != first


def test_a_rule_that_is_not_a_number_stops_the_step_naming_its_parameter():
    loss = CompiledLoss(dsl.parse("c = 1\nc ← c·log(batch_mean(A) + 1) in [0, 5]\nr*A - c*r"))
    logp, old, A, mask, ref = batch(6)
    train_call(loss, logp, old, -2.0 + 0 * A, mask, ref)
    with pytest.raises(ValueError, match=r"controlled parameter 'c' \(line 2\).*log\(batch_mean\(A\) \+ 1\) is nan"):
        loss.end_step()


def test_end_step_without_a_training_call_is_refused():
    with pytest.raises(RuntimeError, match="without a training call"):
        kl_loss().end_step()


# ---------------------------------------------------------------- state: resume
def test_a_resumed_loss_continues_the_values_and_the_step():
    straight, first = kl_loss(), kl_loss()
    steps = [batch(20 + i) for i in range(4)]
    want = []
    for data in steps:
        want.append(train_call(straight, *data))
        straight.end_step()
    for data in steps[:2]:
        train_call(first, *data)
        first.end_step()
    resumed = kl_loss()
    resumed.load_control_state(first.control_state())
    got = want[:2]
    for data in steps[2:]:
        got.append(train_call(resumed, *data))
        resumed.end_step()
    assert got == want and resumed.control_state() == straight.control_state()
    forgot = kl_loss()        # breakage: the state not restored
    assert train_call(forgot, *steps[2]) != want[2]


def test_a_saved_state_is_json_and_refused_mid_step_for_another_objective_or_out_of_bounds():
    import json
    loss = kl_loss()
    train_call(loss, *batch(7))
    with pytest.raises(RuntimeError, match="not ended by end_step"):
        loss.control_state()
    loss.end_step()
    state = json.loads(json.dumps(loss.control_state()))
    other = CompiledLoss("adaptive_entropy")
    with pytest.raises(ValueError, match="resume with the same objective"):
        other.load_control_state(state)
    with pytest.raises(ValueError, match="outside its bounds"):
        kl_loss().load_control_state({**state, "values": {"beta": 11.0}})
    with pytest.raises(ValueError, match="has no controlled parameter"):
        CompiledLoss("ppo").load_control_state(state)


def test_an_objective_without_memory_has_no_state():
    loss = CompiledLoss("ppo")
    assert loss.controller is None and loss.end_step() == {} and loss.control_state() is None
    assert "memory" not in loss.inputs() and "memory" in kl_loss().inputs()


# ---------------------------------------------------------------- ranks
def _rank(rank, world, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1")
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    runs = []
    for all_reduce in (True, False):
        if not all_reduce:       # breakage: each rank its own statistic
            core_controls._distributed = lambda group: False
        loss, seen = kl_loss(), []
        for step in range(3):
            data = batch(100 * step + rank)           # different data on each rank
            train_call(loss, *data)
            seen.append(loss.end_step()["drpo_beta"])
        runs.append(seen)
    torch.save(runs, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's β at each step: with the all-reduce, then without it (one spawn for both)."""
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank, args=(2, folder / "store", folder / "values"), nprocs=2, join=True)
    return [torch.load(folder / f"values.{r}") for r in range(2)]


def test_two_ranks_hold_identical_values_equal_to_one_process_over_both_ranks_data(two_ranks):
    ranks = [runs[0] for runs in two_ranks]
    alone, want = kl_loss(), []
    for step in range(3):
        for rank in range(2):
            train_call(alone, *batch(100 * step + rank))
        want.append(alone.end_step()["drpo_beta"])
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(want, rel=1e-14, abs=0)


def test_two_ranks_without_the_all_reduce_differ(two_ranks):
    assert two_ranks[0][1] != two_ranks[1][1]


# ---------------------------------------------------------------- the statistic against the reference
def _has_batch_reduction(expr: Node) -> bool:
    from dsl.operations import OPS
    return any(n.op in OPS and OPS[n.op].over == "batch" for n in expr.walk())


@pytest.mark.parametrize("index", range(60))
def test_a_rule_statistic_agrees_with_the_independent_float64_reference_on_random_objectives(index):
    """batch_mean(ℓ) of a random objective ℓ, as the loss core sums it (float64, masked slots dirty),
    against tests/reference_dual.py's value of the objective batch_mean(ℓ) (its loss is −that)."""
    from adversarial_batches import batch as draw_batch
    from differential import tensors
    from random_objectives import objective
    from reference_dual import reference
    _, obj = objective(7, index)
    # the statistic is the batch's, whatever the host's aggregation: the reference's loss under token-mean
    b = {**draw_batch(np.random.default_rng([7, index])), "mode": "token-mean", "weights": None, "norm": None}
    if _has_batch_reduction(obj.expr) or not b["mask"].any():
        pytest.skip("a statistic nests no batch reduction (a rule refuses it); no token, no statistic")
    stat = Node("batch_mean", (obj.expr,))
    want = -float(reference(replace(obj, expr=stat), b)["loss"])
    controlled = replace(obj, params={**obj.params, "c": 0}, controls={
        "c": Control("c", stat, -1e300, 1e300, obj.expr.pos or dsl.ir.Pos(1, 1))})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = CompiledLoss(controlled, fused=False)
    t = tensors(b)
    out = loss(t["logp"], t["old"], t["A"], t["mask"], rollout_log_probs=t["rollout"], ref_log_probs=t["ref"],
               entropy=t["H"], sum_pi_sq=t["sum_pi_sq"], groups=t["groups"], turns=t["turns"],
               staleness=t["staleness"], vocab_log_probs=t["vocab_logp"], vocab_ref_log_probs=t["vocab_ref"])
    del out
    if not math.isfinite(want):
        with pytest.raises(ValueError, match="controlled parameter 'c'"):
            loss.end_step()
        return
    got = loss.end_step()["drpo_c"]
    assert got == pytest.approx(min(max(want, -1e300), 1e300), rel=1e-9, abs=1e-9 * max(1.0, abs(want))), \
        obj.canonical()


# ---------------------------------------------------------------- the spelling
@pytest.mark.parametrize("name", ["adaptive_kl", "adaptive_entropy", "clip_schedule", "kl_loss_ctrl"])
def test_a_shipped_objective_with_memory_reads_back_from_its_canonical_text(name):
    obj = dsl.load(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # (canonical() inlines the definitions it also lists)
        again = dsl.parse(obj.canonical())
    assert again.controls == obj.controls and again.params == obj.params and again.expr == obj.expr


def test_ascii_and_unicode_spell_one_rule():
    text = "β = 0.1\n{}\nr*A - β*r"
    unicode = dsl.parse(text.format("β ← β·(1 + batch_mean(A)) ∈ [0, 1]"))
    ascii_ = dsl.parse(text.format("beta <- beta*(1 + batch_mean(A)) in [0, 1]"))
    assert unicode.controls["beta"].rule == ascii_.controls["beta"].rule
    assert (unicode.controls["beta"].low, unicode.controls["beta"].high) == (0.0, 1.0)


@pytest.mark.parametrize("line, message, col", [
    ("β ← β*2", "has no bounds", 8),
    ("β ← β*2 in [1, 0]", "are empty or a single point", 13),
    ("β ← β*2 in [0.2, 1]", "at the first step, 0.1, is outside its bounds", 1),
    ("β ← β*r in [0, 1]", "depends on the position: 'r' is one value per token", 7),
    ("β ← β*seq_mean(A) in [0, 1]", "depends on the position: 'seq_mean(A)'", 7),
    ("β ← β*batch_quantile(A, 0.5) in [0, 1]", "an order statistic is not exact", 7),
    ("β ← batch_mean(A - batch_mean(A)) in [0, 1]", "reads another batch reduction", 20),
    ("t = 0\nβ ← β*(1 + batch_mean(A)/t) in [0, 1]", "divides by 't' = 0, which is not positive", 26),
    ("t = -6\nβ ← β*(1 + batch_mean(A)/t) in [0, 1]", "divides by 't' = -6, which is not positive", 26),
    ("γ ← 1 in [0, 1]", "'γ' is not defined: only a parameter is controlled", 1),
    ("r ← 1 in [0, 1]", "'r' is a built-in", 1),
    ("step = 3", "'step' is a built-in", 1),
    ("β ← 1 in [0, 1]\nβ ← 0 in [0, 1]", "has a second update rule", 1),
    ("β ← β in [0, step]", "a bound must be a constant", 14),
])
def test_a_bad_rule_is_a_located_error(line, message, col):
    text = f"β = 0.1\n{line}\nr*A - β*r"
    with pytest.raises(dsl.DslError) as err:
        dsl.parse(text)
    assert message in err.value.message
    assert (err.value.line, err.value.col) == (text.split("\n").index(line.split("\n")[-1]) + 1, col)


def test_a_statistic_reads_the_groups_its_objective_does_not():
    """The rule's group_std needs the groups whole even where the objective itself reads none."""
    loss = CompiledLoss(dsl.parse("c = 1\nc ← c*(1 + 0.1*batch_mean(group_std(seq_mean(A)))) in [0, 2]\nr*A - c*r"))
    assert "groups" in loss.inputs()
    logp = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)
    A = torch.tensor([[1.0] * 3, [0.0] * 3, [2.0] * 3, [2.0] * 3], dtype=torch.float64)
    loss(logp, logp.detach(), A, groups=torch.tensor([0, 0, 1, 1])).loss.backward()
    # group 0's sample std of (1, 0) on its 6 tokens, group 1's 0 on its 6: the batch's token mean is √2/4
    assert loss.end_step()["drpo_c"] == pytest.approx(1 + 0.1 * math.sqrt(2) / 4, rel=1e-15)


@pytest.mark.parametrize("override, message", [
    ({"kl_target": 0}, "divides by 'kl_target' = 0, which is not positive"),
    ({"horizon": 0}, "divides by 'horizon' = 0, which is not positive"),
    ({"kl_target": -6}, "divides by 'kl_target' = -6, which is not positive"),
])
def test_an_override_cannot_set_a_controllers_target_or_horizon_the_file_is_refused_for(override, message):
    with pytest.raises(dsl.DslError) as err:
        kl_loss(**override)
    assert message in err.value.message and err.value.col == len(next(iter(override))) + 2


def test_a_bound_written_as_a_parameter_moves_with_its_override():
    obj = dsl.parse("lo = 0\nβ = 0.05\nβ ← β·(1 + batch_mean(A)) in [lo, 10]\nr*A - β*r + 0*lo")
    assert CompiledLoss(obj, lo=0.01).objective.controls["beta"].low == 0.01
    with pytest.raises(dsl.DslError, match=r"'β' = 0.05 is outside its bounds \[0.1, 10\]"):
        CompiledLoss(obj, lo=0.1)
    with pytest.raises(dsl.DslError, match="are not finite with low < high"):
        CompiledLoss(obj, lo=20)


def test_a_saved_state_of_another_objective_with_the_same_names_or_a_step_that_is_not_whole_is_refused():
    source = CompiledLoss("adaptive_kl")          # controls β, as kl_loss_ctrl does
    train_call(source, *batch(3))
    source.end_step()
    state = source.control_state()
    with pytest.raises(ValueError, match="resume with the same objective"):
        CompiledLoss("kl_loss_ctrl").load_control_state(state)
    for step in (2.5, -1, "3"):
        with pytest.raises(ValueError, match="not a whole number"):
            CompiledLoss("adaptive_kl").load_control_state({**state, "step": step})


def test_a_rules_statistic_of_pi_ref_leaves_openrlhfs_own_kl_loss_trained():
    """The actor zeroes OpenRLHF's KL loss only where the objective's own terms are the KL trained."""
    from openrlhf_drpo.hosts.openrlhf.inputs import trains_the_kl
    stat_only = CompiledLoss(dsl.parse("c = 1\nc ← c·(1 + 0.1·batch_mean(log(π_old) - log(π_ref))) in [0, 2]\n"
                                       "min(r*A, clip(r, 0.8, 1.2)*A) + 0*c"))
    assert "ref_log_probs" in stat_only.inputs()          # it is fed π_ref, for its statistic
    assert not trains_the_kl(stat_only) and trains_the_kl(CompiledLoss("adaptive_kl"))


def test_a_controlled_value_is_checked_against_its_bounds_at_the_overridden_values():
    obj = dsl.parse("lo = 0\nβ = 0.05\nβ ← β·(1 + batch_mean(A)) in [lo, 10]\nr*A - β*r + 0*lo")
    assert CompiledLoss(obj, lo=-5, β=-1).objective.params["beta"] == -1
    with pytest.raises(dsl.DslError, match=r"'β' = 11 is outside its bounds \[0, 10\]") as err:
        CompiledLoss(obj, β=11)
    assert err.value.col == len("β") + 2


@pytest.mark.parametrize("lines, col", [
    ("α = 1\nα ← α in [0, 2]\nβ ← β in [0, α]", 14),      # another controlled parameter
    ("β ← β in [0, 2*β]", 14),                              # its own
])
def test_a_bound_that_reads_a_controlled_parameter_is_a_located_error(lines, col):
    text = f"β = 0.1\n{lines}\nr*A - β*r"
    with pytest.raises(dsl.DslError, match="a bound must be a constant") as err:
        dsl.parse(text)
    assert (err.value.line, err.value.col) == (text.count("\n") , col)


def test_a_step_set_at_launch_survives_the_is_correction_composed_with_the_objective():
    from openrlhf_drpo.hosts.openrlhf.options import compose
    obj = dsl.load("clip_schedule").with_overrides({"step": "5"})
    assert "# step = 5" in obj.canonical()                   # a comment: the text alone would restart at 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert compose(obj, "1").params["step"] == 5


def test_a_missing_bound_is_located_after_the_rule_not_after_a_trailing_comment():
    with pytest.raises(dsl.DslError, match="has no bounds") as err:
        dsl.parse("β = 0.1\nβ ← β*2   # double it\nr*A - β*r")
    assert (err.value.line, err.value.col) == (2, len("β ← β*2") + 1)
