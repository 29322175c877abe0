"""ObjectiveGRPOTrainer with gradient accumulation and a batch objective (issue 39, item 1):
gradient_accumulation_steps=4, each optimizer step's batch statistics taken in no-grad passes over
TRL's buffered slices of its generation batch, summed over the processes. On one process, each
training call's gradient to log π is its rows of the one-pass gradient of the step's 4 slices in
one loss call, and, for the objectives written out by hand, of that hand-written loss (no code of
the package). On two CPU processes (a gloo group), each call's gradient on each rank is its rows of
the hand-written gradient of the step's 8 slices (both ranks' 4) in one loss."""
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig

from dsl import parse
from openrlhf_drpo.core import Aggregation, CompiledLoss
from openrlhf_drpo.lab.toytask import SPECIAL, WORDS, tiny_llama
from openrlhf_drpo.trl import ObjectiveGRPOTrainer
from test_accumulation_train import by_hand
from test_trl import reward

OBJECTIVES = {"trust_the_batch": "trust_the_batch", "batch_mean_r_A": "batch_mean(r)*A\n"}
# step 2 trains step 1's generation batch again (num_iterations=2): π has moved from μ, so that
# trust_the_batch's ESS is below 1 (at π = μ it is 1 in any batch)
MICRO, STEPS = 4, 2


def tiny(directory):
    """The tiny Llama, saved (before a process group exists: transformers saves on rank 0 only)."""
    model, _, model_dir = tiny_llama(str(directory), SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)
    return model_dir


def accumulated(tmp_path, objective, model_dir=None):
    """Each training call's inputs and gradient to log π, and the no-grad calls' count before each
    (under RANK/WORLD_SIZE, those of this process)."""
    tmp_path = pathlib.Path(tmp_path)
    model_dir = model_dir or tiny(tmp_path)
    prompts = Dataset.from_list([{"prompt": " ".join(WORDS[(3 * i + j) % 16] for j in range(4))} for i in range(64)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to="none",
                      save_strategy="no", seed=0, data_seed=0, bf16=False, temperature=1.0, dataloader_num_workers=0,
                      num_iterations=2, beta=0.0, loss_type="dapo", gradient_accumulation_steps=MICRO)
    obj = objective if objective == "trust_the_batch" else parse(objective, "batch_mean_r_A.dsl")
    trainer = ObjectiveGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=prompts,
                                   processing_class=AutoTokenizer.from_pretrained(model_dir), objective=obj)
    loss_fn, calls, no_grad = trainer.objective_loss, [], []
    forward = loss_fn.forward

    def recording(log_probs, old, A, mask=None, **kw):
        out = forward(log_probs, old, A, mask, **kw)
        if not log_probs.requires_grad:
            no_grad.append(len(calls))
            return out
        (grad,) = torch.autograd.grad(out.loss, log_probs, retain_graph=True)
        agg = kw["aggregation"]
        calls.append({"log_probs": log_probs.detach(), "old": old.detach(), "A": A.detach(), "mask": mask.bool(),
                      "weights": agg.weights.detach(), "norm": float(agg.norm), "grad": grad})
        return out
    loss_fn.forward = recording
    # a seed per process, as TRL's own (set_seed(seed, device_specific=True)): with one seed the
    # ranks' near-uniform tiny model samples the same tokens, rewards and advantages on both
    torch.manual_seed(trainer.accelerator.process_index)
    trainer.train()
    return calls, no_grad, loss_fn.generated.batch_depth


@pytest.fixture(scope="module", params=list(OBJECTIVES))
def run(request, tmp_path_factory):
    return request.param, accumulated(tmp_path_factory.mktemp(request.param), OBJECTIVES[request.param])


def steps(calls):
    """Each optimizer step's 4 calls as one batch (padded: masked), float64."""
    for k in range(STEPS):
        step = calls[k * MICRO:(k + 1) * MICRO]
        width = max(c["mask"].shape[1] for c in step)
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))      # noqa: E731
        yield step, {key: torch.cat([pad(c[key].double() if key != "mask" else c[key]) for c in step])
                     for key in ("log_probs", "old", "A", "mask", "weights", "grad")}


def test_each_step_takes_its_statistics_before_its_first_micro_batch(run):
    _, (calls, no_grad, passes) = run
    assert len(calls) == STEPS * MICRO
    assert no_grad == [k * MICRO for k in range(STEPS) for _ in range(passes * MICRO)]


def test_4_accumulated_micro_batches_give_the_one_pass_gradient_of_the_package(run):
    """The step's 4 slices in one loss call (the package's plain path; dapo's normalizer is the
    step's, the same in each call) give each token the gradient it got in its own call."""
    name, (calls, _, _) = run
    for step, b in steps(calls):
        assert len({c["norm"] for c in step}) == 1
        obj = name if name == "trust_the_batch" else parse(OBJECTIVES[name], "b.dsl")
        lp = b["log_probs"].clone().requires_grad_()
        loss, _ = CompiledLoss(obj, fused=False)(lp, b["old"], b["A"], b["mask"],
                                                 aggregation=Aggregation("token-mean", norm=step[0]["norm"],
                                                                         weights=b["weights"]))
        (whole,) = torch.autograd.grad(loss, lp)
        assert torch.allclose(b["grad"], whole, rtol=1e-4, atol=1e-7), float((b["grad"] - whole).abs().max())


def test_4_accumulated_micro_batches_give_the_hand_written_gradient(run):
    name, (calls, _, _) = run
    for step, b in steps(calls):
        assert torch.equal(b["weights"][b["mask"]], torch.ones_like(b["weights"][b["mask"]]))     # dapo: no weights
        lp = b["log_probs"].clone().requires_grad_()
        (expected,) = torch.autograd.grad(by_hand(name, lp, b["old"], b["A"], b["mask"], step[0]["norm"]), lp)
        assert torch.allclose(b["grad"], expected, rtol=1e-4, atol=1e-7), float((b["grad"] - expected).abs().max())
        assert (expected != 0).any()
    # the case can tell: on the off-policy step, each call's batch alone would be another gradient
    own = torch.cat([torch.nn.functional.pad(torch.autograd.grad(
        by_hand(name, (x := c["log_probs"].double().requires_grad_()), c["old"].double(), c["A"].double(), c["mask"],
                c["norm"]), x)[0], (0, b["grad"].shape[1] - c["mask"].shape[1])) for c in step])
    assert not torch.allclose(own, b["grad"], rtol=1e-3, atol=1e-6)


# one rank of a two-process gloo group (accelerate reads RANK, WORLD_SIZE and MASTER_*): both
# objectives' runs, each rank's calls saved to a file (a pipe this big could deadlock)
RANK = """
import sys, torch
directory, rank = sys.argv[1], sys.argv[2]
import test_accumulation_trl as t
model_dir = t.tiny(f"{directory}/rank{rank}")
for name, objective in t.OBJECTIVES.items():
    calls, no_grad, passes = t.accumulated(f"{directory}/rank{rank}/{name}", objective, model_dir)
    torch.save({"calls": calls, "no_grad": no_grad, "passes": passes,
                "world": torch.distributed.get_world_size()}, f"{directory}/{name}.rank{rank}.pt")
"""


def run_two_ranks(code: str, directory) -> None:
    """`code` (python -c, argv: directory, rank) on two CPU processes of one torch.distributed world
    (RANK, WORLD_SIZE, a free port), each one's output in directory/out<rank>; both must exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2")
    logs = [open(directory / f"out{r}", "w") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(directory), str(r)], stdout=logs[r],
                              stderr=subprocess.STDOUT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    codes = [p.wait(timeout=900) for p in procs]
    for log in logs:
        log.close()
    assert codes == [0, 0], [(directory / f"out{r}").read_text()[-3000:] for r in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each objective's recorded run on each of two CPU processes."""
    directory = tmp_path_factory.mktemp("ranks")
    run_two_ranks(RANK, directory)
    return {name: [torch.load(directory / f"{name}.rank{r}.pt") for r in range(2)] for name in OBJECTIVES}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_2_ranks_of_4_accumulated_micro_batches_give_the_hand_written_gradient_of_the_whole_step(two_ranks, name):
    """Each training call's gradient to log π, on each of 2 processes, is its rows of the
    hand-written one-pass gradient of the step's 8 micro-batches (both ranks' 4) in one loss."""
    ranks = two_ranks[name]
    assert [r["world"] for r in ranks] == [2, 2]
    for r in ranks:
        assert len(r["calls"]) == STEPS * MICRO
        assert r["no_grad"] == [k * MICRO for k in range(STEPS) for _ in range(r["passes"] * MICRO)]
    for k in range(STEPS):
        per_rank = [list(steps(r["calls"]))[k] for r in ranks]
        step = [c for s, _ in per_rank for c in s]
        assert len({c["norm"] for c in step}) == 1      # dapo: the generation batch's tokens over both ranks
        width = max(b["mask"].shape[1] for _, b in per_rank)
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))      # noqa: E731
        b = {key: torch.cat([pad(rb[key]) for _, rb in per_rank]) for key in ("log_probs", "old", "A", "mask", "grad")}
        lp = b["log_probs"].clone().requires_grad_()
        (expected,) = torch.autograd.grad(by_hand(name, lp, b["old"], b["A"], b["mask"], step[0]["norm"]), lp)
        assert torch.allclose(b["grad"], expected, rtol=1e-4, atol=1e-7), float((b["grad"] - expected).abs().max())
        assert (expected != 0).any()
    # the case can tell: on the off-policy step, one rank's 4 micro-batches alone would be another gradient
    alone = torch.cat([pad(torch.autograd.grad(by_hand(name, (x := rb["log_probs"].clone().requires_grad_()), rb["old"],
                                                       rb["A"], rb["mask"], step[0]["norm"]), x)[0])
                       for _, rb in per_rank])
    assert not torch.allclose(alone, expected, rtol=1e-3, atol=1e-6)
