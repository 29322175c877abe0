"""Batch reductions exact across micro-batches and ranks (issue 39, item 1): two gloo ranks, each
with 4 micro-batches of its own sizes and lengths, take the step's batch statistics in no-grad
passes (core.collectives.BatchStatistics), then one loss call and backward per micro-batch: each
token's gradient is the one-pass, whole-batch gradient (each rank's micro-batches in one call,
summed over the ranks by the process group), float64, to 1e-10; and, for the objectives written
out by hand, the hand-written gradient of the whole batch (no code of the package). Each pass is
one all-reduce; the training calls issue none."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from test_collectives import hand_written

F64 = torch.float64
# the shipped batch objective (its statistics under sg), batch_mean(r)*A (S with a gradient: λ =
# Σ coef·A), one under sg, two whose sums nest (an adjoint that reads S; S inside S: two passes),
# one over responses
OBJECTIVES = {"trust_the_batch": 1, "batch_mean(r)*A": 1, "sg(batch_mean(r))*r*A": 1,
              "batch_mean(r*A)*batch_sum(r)/batch_count(A)": 2, "batch_mean((r - batch_mean(r))^2)*A": 2,
              "batch_mean(seq_mean(r))*A": 1}
PATHS = {"eager": {}, "sync-free": {"sync_free": True}, "lab": {"track_extremes": True}}
AGGREGATIONS = ("token-mean", "weighted", "seq-mean-token-mean")
ROWS = ((2, 3, 1, 2), (3, 2, 2, 1))        # each rank's micro-batches' rows, and their lengths:
LENGTHS = (5, 7, 6, 4)
T, NORM = max(LENGTHS), 13.0


def micro_batches(rank):
    """A rank's 4 micro-batches (log π, μ's log-probs, A, mask, host weights), float64."""
    g = torch.Generator().manual_seed(39 + rank)
    out = []
    for rows, length in zip(ROWS[rank], LENGTHS):
        old = -torch.rand(rows, length, generator=g, dtype=F64) * 2 - 0.05
        new = old + 0.3 * torch.randn(rows, length, generator=g, dtype=F64)
        A = torch.randn(rows, length, generator=g, dtype=F64)
        mask = torch.rand(rows, length, generator=g) > 0.3
        weights = torch.rand(rows, length, generator=g, dtype=F64) + 0.5
        out.append((new, old, A, mask, weights))
    return out


def pad(x, fill=0.0):
    return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=fill)


def padded(parts):
    """The micro-batches as one batch of length T (masked padding, finite)."""
    return [torch.cat([pad(x, False if x.dtype == torch.bool else 0.5) for x in xs]) for xs in zip(*parts)]


def load(text):
    import dsl
    return dsl.load(text) if text in dsl.shipped_names() else dsl.parse(text, "batch.dsl")


def aggregation(kind, weights, group):
    from openrlhf_drpo.core import Aggregation
    mode = "seq-mean-token-mean" if kind == "seq-mean-token-mean" else "token-mean"
    return Aggregation(mode, norm=NORM, weights=weights if kind == "weighted" else None, process_group=group)


_RANK = """
import datetime, json, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_accumulation import AGGREGATIONS, OBJECTIVES, PATHS, aggregation, load, micro_batches, pad, padded
from openrlhf_drpo.core import CompiledLoss
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=400))
group, all_reduce, issued = dist.group.WORLD, dist.all_reduce, []
dist.all_reduce = lambda tensor, *a, **k: (issued.append(list(tensor.shape)), all_reduce(tensor, *a, **k))[1]
parts = micro_batches(rank)
for text in OBJECTIVES:
    for path, options in PATHS.items():
        for kind in AGGREGATIONS:
            loss_fn = CompiledLoss(load(text))
            for k, v in options.items():
                setattr(loss_fn, k, v)
            stats = loss_fn.batch_statistics(group)
            issued.clear()
            for _ in stats.recording():
                with torch.no_grad():
                    for new, old, A, mask, w in parts:
                        loss_fn(new, old, A, mask, aggregation=aggregation(kind, w, stats))
            recording, grads, loss = list(issued), [], 0.0
            issued.clear()
            for new, old, A, mask, w in parts:
                lp = new.clone().requires_grad_()
                out, _ = loss_fn(lp, old, A, mask, aggregation=aggregation(kind, w, stats))
                out.backward()
                grads.append(lp.grad)
                loss += out.item()
            training = list(issued)
            new, old, A, mask, w = padded(parts)
            lp = new.clone().requires_grad_()
            whole, _ = CompiledLoss(load(text), fused=False)(lp, old, A, mask, aggregation=aggregation(kind, w, group))
            whole.backward()
            print(json.dumps(dict(key=[text, path, kind], recording=recording, training=training, loss=loss,
                                  passes=stats.passes, grad=torch.cat([pad(g) for g in grads]).tolist(),
                                  whole_loss=whole.item(), whole=lp.grad.tolist())), flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
import os
os._exit(0)     # no interpreter teardown: gloo's threads can abort it (test_collectives)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's calls by (objective, path, aggregation), and each rank's exit status and error."""
    where = tmp_path_factory.mktemp("accumulation")
    code = _RANK.format(tests=str(pathlib.Path(__file__).parent), store=str(where / "store"))
    # into files, not pipes: a rank blocked on a full pipe that is not yet read stalls the other's collectives
    files = [(open(where / f"out{rank}", "w"), open(where / f"err{rank}", "w")) for rank in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], stdout=out, stderr=err, text=True)
             for rank, (out, err) in enumerate(files)]
    try:
        for p in procs:
            p.wait(timeout=900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for out, err in files:
            out.close(), err.close()
    read = lambda name: (where / name).read_text()      # noqa: E731
    return [({tuple(c["key"]): c for c in map(json.loads, read(f"out{rank}").splitlines())},
             (p.returncode, read(f"err{rank}")[-3000:])) for rank, p in enumerate(procs)]


def calls(ranks, *key):
    for done, status in ranks:
        assert key in done, status
    return [done[key] for done, _ in ranks]


def test_both_ranks_run_every_accumulated_step(ranks):
    assert [status for _, status in ranks] == [(0, status[1]) for _, status in ranks]


@pytest.mark.parametrize("kind", AGGREGATIONS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("text", OBJECTIVES)
def test_four_micro_batches_on_two_ranks_give_the_one_pass_gradient_of_the_package(ranks, text, path, kind):
    """Each token's gradient, accumulated over 4 micro-batches on each of 2 ranks, is the package's
    one-pass gradient of the whole batch (its plain path, each rank's micro-batches in one call,
    summed over the ranks by autograd's all-reduce), and the losses add up to its."""
    both = calls(ranks, text, path, kind)
    for call in both:
        got, whole = torch.tensor(call["grad"], dtype=F64), torch.tensor(call["whole"], dtype=F64)
        assert torch.allclose(got, whole, rtol=1e-10, atol=1e-14), float((got - whole).abs().max())
        assert call["loss"] == pytest.approx(call["whole_loss"], rel=1e-10, abs=1e-14)
        assert (whole != 0).sum() > 0      # not vacuous


@pytest.mark.parametrize("text", ["trust_the_batch", "batch_mean(r)*A"])
def test_four_micro_batches_on_two_ranks_give_the_hand_written_gradient(ranks, text):
    """The same against the loss written by hand (test_collectives.hand_written, over NORM tokens:
    no code of the package), the two ranks' batches as one."""
    import test_collectives
    new, old, A, mask, _ = (torch.cat(xs) for xs in zip(*[padded(micro_batches(r)) for r in (0, 1)]))
    lp = new.clone().requires_grad_()
    original, test_collectives.NORM = test_collectives.NORM, NORM
    try:
        (expected,) = torch.autograd.grad(hand_written(text, lp, old, A, mask), lp)
    finally:
        test_collectives.NORM = original
    got = torch.cat([torch.tensor(call["grad"], dtype=F64) for call in calls(ranks, text, "eager", "token-mean")])
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("text", OBJECTIVES)
def test_each_pass_is_one_all_reduce_and_the_training_calls_issue_none(ranks, text):
    """As many no-grad passes as the objective's sums nest, each one all-reduce of its totals
    (shapes from the objective alone, the same on both ranks); the training calls read the totals."""
    for path in PATHS:
        for kind in AGGREGATIONS:
            both = calls(ranks, text, path, kind)
            assert [c["passes"] for c in both] == [OBJECTIVES[text]] * 2
            assert both[0]["recording"] == both[1]["recording"] and len(both[0]["recording"]) == OBJECTIVES[text]
            assert [c["training"] for c in both] == [[], []]


def _stats_and_batches():
    from openrlhf_drpo.core import CompiledLoss
    loss_fn = CompiledLoss(load("batch_mean(r)*A"))
    return loss_fn, loss_fn.batch_statistics(), micro_batches(0)


def test_batch_statistics_on_the_plain_path_are_refused_naming_the_fused_path():
    from openrlhf_drpo.core import CompiledLoss
    loss_fn = CompiledLoss(load("batch_mean(r)*A"), fused=False)
    new, old, A, mask, w = micro_batches(0)[0]
    with pytest.raises(ValueError, match=r"BatchStatistics .* needs the fused path.* use fused=True"):
        loss_fn(new, old, A, mask, aggregation=aggregation("token-mean", w, loss_fn.batch_statistics()))


def test_a_training_call_before_any_recording_pass_is_refused():
    loss_fn, stats, parts = _stats_and_batches()
    new, old, A, mask, w = parts[0]
    with pytest.raises(RuntimeError, match="before any recording pass"):
        loss_fn(new, old, A, mask, aggregation=aggregation("token-mean", w, stats))


def test_a_micro_batch_whose_call_asks_for_other_sums_is_refused():
    """Host weights on one micro-batch and not on the next: another sequence of sums (the objective's
    own gradient for w is one more evaluation), never summed into the wrong statistic."""
    loss_fn, stats, parts = _stats_and_batches()
    with pytest.raises(RuntimeError, match="must have the same configuration"):
        for _ in stats.recording():
            with torch.no_grad():
                for i, (new, old, A, mask, w) in enumerate(parts):
                    loss_fn(new, old, A, mask, aggregation=aggregation("weighted" if i else "token-mean", w, stats))


def test_an_objective_without_a_batch_reduction_takes_no_statistics():
    from openrlhf_drpo.core import CompiledLoss
    assert CompiledLoss(load("drpo")).batch_statistics() is None
