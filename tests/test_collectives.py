"""Collectives never depend on the data (issue 36): two gloo ranks, one holding NaN and ±inf in its
masked slots, the other no token at all, issue the same all-reduces (op, shape, dtype, in order)
as with clean batches, in the number the objective alone sets, on every path of the loss (the
CPU's eager kernel, the sync-free one that CUDA runs, the plain one, drpo-lab's extremes); and
each rank's gradient is its rows of the whole batch's gradient, written out by hand."""
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

import dsl
from openrlhf_drpo.core.loss import objective_inputs

F64 = torch.float64
# every shipped objective with a batch reduction, and a batch mean whose gradient needs a second
# all-reduce (its adjoint: Σ coef·A over the ranks); but a batch quantile, refused across ranks (its
# order statistics need the ranks' values, not their sums: tests/test_order_stats.py)
OBJECTIVES = [n for n in dsl.shipped_names() if "batch" in objective_inputs(dsl.load(n))
              and not any(m.op == "batch_quantile" for m in dsl.load(n).expr.walk())] + ["batch_mean(r)*A"]
PATHS = {"eager": dict(fused=True), "sync-free": dict(fused=True, sync_free=True), "plain": dict(fused=False),
         "lab": dict(fused=True, track_extremes=True)}
# all-reduces in one loss call, forward and backward, on the fused paths: one per batch reduction
# of the objective (trust_the_batch: Σw, Σw², the count) and one per adjoint that reads the policy
# (batch_mean(r)*A: Σ coef·A); the plain path adds its own (autograd's: the forward's and, through
# an all-reduce that reads π, the backward's) to its metrics' fused pass; the lab one more
# evaluation of the fused code
FUSED = {"trust_the_batch": 3, "batch_mean(r)*A": 2}
PLAIN = {"trust_the_batch": 3, "batch_mean(r)*A": 2}
B, T, NORM = 4, 7, 11.0     # NORM: a global token normalizer, so that the ranks' token sums add up


def load(text):
    return dsl.load(text) if text in dsl.shipped_names() else dsl.parse(text, "batch.dsl")


VARIANTS = ("clean", "junk", "junk-both")


def halves(variant):
    """Each rank's (log π, μ's log-probs, A, mask), float64. 'clean': finite everywhere, tokens on
    both ranks; 'junk': NaN, +inf, -inf in rank 0's masked slots, and rank 1 with no token (every
    slot masked, finite: only rank 0's eager kernel falls back); 'junk-both': rank 1's junk too."""
    g = torch.Generator().manual_seed(36)
    out = []
    for rank in (0, 1):
        old = -torch.rand(B + rank, T, generator=g, dtype=F64) * 2 - 0.05
        new = old + 0.3 * torch.randn(B + rank, T, generator=g, dtype=F64)
        A = torch.randn(B + rank, T, generator=g, dtype=F64)
        mask = torch.rand(B + rank, T, generator=g) > 0.3
        if variant != "clean":
            mask = mask if rank == 0 else torch.zeros_like(mask)
        if variant == "junk-both" or (variant == "junk" and rank == 0):
            junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=F64).repeat(new.numel())[: new.numel()]
            new, old, A = (torch.where(mask, x, junk.view_as(x)) for x in (new, old, A))
        out.append((new, old, A, mask))
    return out


_RANK = """
import datetime, json, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_collectives import OBJECTIVES, PATHS, NORM, VARIANTS, halves, load
from openrlhf_drpo.core import Aggregation, CompiledLoss
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
group, all_reduce, issued = dist.group.WORLD, dist.all_reduce, []


def recorded(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    issued.append([str(op).split(".")[-1], list(tensor.shape), str(tensor.dtype)])
    return all_reduce(tensor, op=op, group=group, async_op=async_op)


dist.all_reduce = recorded
for text in OBJECTIVES:
    for path, options in PATHS.items():
        for variant in VARIANTS:
            new, old, A, mask = halves(variant)[rank]
            loss_fn = CompiledLoss(load(text), fused=options["fused"])
            loss_fn.sync_free = options.get("sync_free", False)
            loss_fn.track_extremes = options.get("track_extremes", False)
            issued.clear()
            before = group._get_sequence_number_for_group()
            lp = new.clone().requires_grad_()
            loss, _ = loss_fn(lp, old, A, mask, aggregation=Aggregation(norm=NORM, process_group=group))
            loss.backward()
            print(json.dumps(dict(key=[text, path, variant], issued=issued, loss=loss.item(), grad=lp.grad.tolist(),
                                  collectives=group._get_sequence_number_for_group() - before)), flush=True)
    for path in ("eager", "sync-free", "plain"):     # each rank's own token count as its normalizer
        new, old, A, mask = halves("clean")[rank]
        loss_fn = CompiledLoss(load(text), fused=PATHS[path]["fused"])
        loss_fn.sync_free = PATHS[path].get("sync_free", False)
        loss, metrics = loss_fn(new.clone().requires_grad_(), old, A, mask, aggregation=Aggregation(process_group=group))
        loss.backward()
        print(json.dumps(dict(key=[text, path, "local"], w_mean=metrics.floats()["drpo_w_mean"])), flush=True)
dist.barrier()
dist.destroy_process_group()      # a clean exit on every rank, whatever the load (no teardown race)
# and no interpreter teardown: gloo's C++ threads can abort it ("terminate called without an active
# exception", exit -6) after every call above has finished and printed
sys.stdout.flush()
import os
os._exit(0)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's calls, by (objective, path, variant): what it issued, its loss and gradient; and
    each rank's exit status and error (a rank whose collectives went astray stops: the calls it
    did not finish are missing)."""
    store = tmp_path_factory.mktemp("collectives") / "store"
    code = _RANK.format(tests=str(pathlib.Path(__file__).parent), store=str(store))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [({tuple(c["key"]): c for c in map(json.loads, out.splitlines())}, (p.returncode, err[-3000:]))
            for p, (out, err) in zip(procs, outs)]


def calls(ranks, *key):
    """The call `key` on each rank; both must have finished it."""
    for done, status in ranks:
        assert key in done, status
    return [done[key] for done, _ in ranks]


def test_both_ranks_run_every_call_and_end_their_process_group(ranks):
    assert [status for _, status in ranks] == [(0, status[1]) for _, status in ranks]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("text", OBJECTIVES)
def test_every_rank_issues_the_same_collectives_whatever_its_values(ranks, text, path):
    """The same all-reduces on both ranks, with clean batches and with NaN/±inf in masked slots on
    one rank and no token on the other; every collective of the group is one of them."""
    seen = [c for variant in VARIANTS for c in calls(ranks, text, path, variant)]
    f64, f32 = ["SUM", [2], "torch.float64"], ["SUM", [2], "torch.float32"]     # the lab evaluates in float32
    expected = [f64] * (FUSED[text] + PLAIN[text] * (path == "plain")) + [f32] * FUSED[text] * (path == "lab")
    for call in seen:
        assert call["issued"] == seen[0]["issued"], (call["key"], call["issued"], seen[0]["issued"])
        assert call["collectives"] == len(call["issued"]), call["key"]
    assert sorted(seen[0]["issued"]) == sorted(expected), seen[0]["issued"]


def hand_written(text, lp, old, A, mask):
    """Each objective's loss over the whole batch in one process, written out by hand from its
    definition (objectives/trust_the_batch.dsl; token-mean over NORM): no code of the package."""
    m = mask
    if text == "batch_mean(r)*A":
        per_token = torch.exp(lp - old)[m].mean() * A
    elif text == "trust_the_batch":
        w = torch.exp(lp - old).detach()
        ess = w[m].sum() ** 2 / (((w[m] ** 2).sum() + 1e-8) * m.sum())
        kl = lp - old + torch.exp(torch.clamp(old - lp, -10, 10)) - 1
        per_token = torch.minimum(w, ess) * lp * A - (1 - ess) * kl      # clip(w, 0, ess): w > 0
    else:
        pytest.fail(f"{text}: write its loss into hand_written")
    return -per_token[m].sum() / NORM


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("text", OBJECTIVES)
def test_the_two_ranks_gradient_is_the_hand_written_gradient_of_the_whole_batch(ranks, text, path, variant):
    """Each rank's gradient is its rows of the gradient of both halves in one process (masked
    slots cleaned: that reference never sees the junk), and the ranks' losses add up to its loss;
    nothing from a masked slot leaks."""
    parts = halves(variant)
    new, old, A, mask = (torch.cat(xs) for xs in zip(*parts))
    new, old, A = (torch.where(mask, x, 0.0) for x in (new, old, A))
    lp = new.clone().requires_grad_()
    loss = hand_written(text, lp, old, A, mask)
    (whole,) = torch.autograd.grad(loss, lp)
    both = calls(ranks, text, path, variant)
    got = torch.cat([torch.tensor(call["grad"], dtype=F64) for call in both])
    assert torch.isfinite(got).all() and torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert torch.allclose(got, whole, rtol=1e-10, atol=1e-15)
    assert math.isclose(sum(call["loss"] for call in both), loss.item(), rel_tol=1e-12)
    assert (whole != 0).sum() > 0      # not vacuous


@pytest.mark.parametrize("text", OBJECTIVES)
def test_w_mean_is_the_same_on_every_path_with_each_ranks_own_normalizer(ranks, text):
    """Without a global normalizer each rank folds its own 1/N into its tokens' weights, and the
    batch reductions' adjoint sums those over the ranks: w_mean is the objective's own all the same
    (the fused paths once divided by the folded weight: 0.1376 where the plain path gives 0.0778)."""
    for rank in (0, 1):
        got = {path: calls(ranks, text, path, "local")[rank]["w_mean"] for path in ("eager", "sync-free", "plain")}
        assert got["eager"] == pytest.approx(got["plain"], rel=1e-12) and \
            got["sync-free"] == pytest.approx(got["plain"], rel=1e-12), (rank, got)
        assert got["plain"] != 0
