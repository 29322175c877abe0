"""drpo-train with gradient accumulation and a batch objective (issue 39, item 1): an optimizer step
of 4 micro-batches on one rank, through the real ActorPPOTrainer.ppo_train (DeepSpeed CPU, ZeRO-2),
takes its batch statistics in no-grad passes of the actor's forward over the step's micro-batches,
then trains each: every micro-batch's gradient to log π is its rows of the step's whole-batch
gradient, written out by hand (no code of the package). Two ranks × 4 micro-batches: the core's
test_accumulation, and drpo-train's gradient over 2 Ray ranks: test_two_ranks.
Both objectives' checks run in one child process, each on an engine of its own
(one_process.checks_in_one_process: the process's start-up once); each check's outcome is its own test's."""
import os
import pathlib

import pytest
import torch

from one_process import checks_in_one_process
from test_train import _experience, tiny_model, train_flags  # noqa: F401  (fixtures)

HERE = pathlib.Path(__file__).parent
OBJECTIVES = {"trust_the_batch": (HERE.parent / "objectives" / "trust_the_batch.dsl").read_text(),
              "batch_mean_r_A": "batch_mean(r)*A\n"}
STEP = ("--rollout.batch_size", "4", "--train.batch_size", "8", "--train.micro_batch_size", "2")
MICRO, RESPONSES, STEPS = 4, 8, 2


def by_hand(name, lp, old, A, mask, norm):
    """The step's loss, written from the objective's definition, over `norm` tokens."""
    m = mask
    if name == "batch_mean_r_A":
        per_token = torch.exp(lp - old)[m].mean() * A
    else:
        w = torch.exp(lp - old).detach()
        ess = w[m].sum() ** 2 / (((w[m] ** 2).sum() + 1e-8) * m.sum())
        kl = lp - old + torch.exp(torch.clamp(old - lp, -10, 10)) - 1
        per_token = torch.minimum(w, ess) * lp * A - (1 - ess) * kl
    return -per_token[m].sum() / norm


def check_accumulated(tiny_model, tmp_path, name):
    from openrlhf.utils import get_strategy
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoPolicyModelActor
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    tmp_path = pathlib.Path(tmp_path)
    path = tmp_path / f"{name}.dsl"
    path.write_text(OBJECTIVES[name])
    args = openrlhf_args(train_flags(tmp_path / "ckpt", tiny_model, str(path), *STEP))
    actor = _DrpoPolicyModelActor(1, 0, "127.0.0.1", int(os.environ["MASTER_PORT"]))
    actor.init_model_from_pretrained(get_strategy(args), tiny_model, max_steps=4)
    assert actor.trainer.strategy.accumulated_gradient == MICRO
    loss_fn, calls, no_grad = actor.trainer.actor_loss_fn, [], []
    forward = loss_fn.forward

    def recording_forward(log_probs, old, adv, action_mask=None, **kw):
        out = forward(log_probs, old, adv, action_mask=action_mask, **kw)
        if not log_probs.requires_grad:         # a batch-statistics pass
            no_grad.append(len(calls))
            return out
        (grad,) = torch.autograd.grad(out[0], log_probs, retain_graph=True)
        calls.append({"log_probs": log_probs.detach(), "old": old, "adv": adv, "mask": action_mask, "grad": grad,
                      "kw": kw})
        return out
    loss_fn.forward = recording_forward
    for seed in range(STEPS):       # one rollout of 4 prompts × 2 responses, one optimizer step of 4 micro-batches
        exp = _experience(actor.tokenizer, actor.actor, seed, B=RESPONSES)
        exp.index = list(range(RESPONSES))
        actor.append(exp)
        actor.fit(kl_ctl=0.5)
    passes = loss_fn.generated.batch_depth
    # each step: its passes over its 4 micro-batches before its first training call
    assert no_grad == [k * MICRO for k in range(STEPS) for _ in range(passes * MICRO)], no_grad
    assert len(calls) == STEPS * MICRO
    for k in range(STEPS):
        step = calls[k * MICRO:(k + 1) * MICRO]
        width = max(c["mask"].shape[1] for c in step)
        pad = lambda x: torch.nn.functional.pad(x.double(), (0, width - x.shape[1]))      # noqa: E731
        lp, old, A, grad = (torch.cat([pad(c[key]) for c in step]) for key in ("log_probs", "old", "adv", "grad"))
        mask = torch.cat([pad(c["mask"]) for c in step]).bool()
        norm = step[0]["kw"]["batch_num_tokens"] / step[0]["kw"]["dp_size"]
        # OpenRLHF's normalizer: the step's tokens over the accumulation (DeepSpeed divides by it again)
        assert norm * MICRO == mask.sum()
        lp.requires_grad_()
        (expected,) = torch.autograd.grad(by_hand(name, lp, old, A, mask, norm), lp)
        assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-7), float((grad - expected).abs().max())
        # the case can tell: each micro-batch's batch alone would be another gradient
        own = torch.cat([pad(torch.autograd.grad(by_hand(name, (x := c["log_probs"].double().requires_grad_()),
                                                         c["old"].double(), c["adv"].double(), c["mask"].bool(), norm),
                                                 x)[0]) for c in step])
        assert not torch.allclose(own, expected, rtol=1e-3, atol=1e-6)


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("accumulated")
    calls = {}
    for name in OBJECTIVES:
        (tmp_path / name).mkdir()
        calls[name] = ("check_accumulated", [tiny_model, str(tmp_path / name), name])
    return checks_in_one_process("test_accumulation_train", calls)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_drpo_train_trains_a_batch_objective_over_4_micro_batches_with_the_whole_steps_gradient(name, results):
    assert results[name]["error"] is None, results[name]["error"]
