"""drpo-train and the third version's inputs (issue 29): π_ref from OpenRLHF's reference model, H
and Σ_v π_v² from the actor's forward, group ids kept from the rollout, and the refusals at
launch (before Ray starts) of what a run's flags cannot give, naming the flags to set."""
import os
import types

import pytest
import torch

from one_process import checks_in_one_process
from test_train import _experience, tiny_model, train_flags  # noqa: F401  (fixtures)

PPO = "min(r*A, clip(r, 0.8, 1.2)*A)"
OBJECTIVES = {"k3": f"{PPO} - 0.04*(π_ref/π - log(π_ref/π) - 1)\n",
              "entropy": f"{PPO} + 0.01*H - 0.05*batch_mean(r)\n",
              "collision": f"{PPO} + 0.01*H - 0.1*sum_π_sq*r\n", "group": "r*(A - group_mean(seq_mean(A)))\n",
              "batch": "r*A - batch_mean(r)\n",
              "grouped": f"r*(A - group_mean(seq_mean(A))) + 0.01*H - 0.1*sum_π_sq*r\n"}
KL_FLAGS = ("--algo.kl.use_loss", "--algo.kl.init_coef", "0.01")
STEP_OF_4 = ("--train.batch_size", "4", "--train.micro_batch_size", "4")


def _objective(tmp_path, name):
    path = tmp_path / f"{name}.dsl"
    path.write_text(OBJECTIVES[name])
    return str(path)


@pytest.mark.parametrize("name, flags, message", [
    ("k3", [], "objective 'k3' uses π_ref, but OpenRLHF passes the reference model's log-probs to the actor only with "
               "--algo.kl.use_loss and --algo.kl.init_coef > 0 (which creates the reference model): set both"),
    ("k3", ["--algo.kl.use_loss", "--algo.kl.init_coef", "0"], "objective 'k3' uses π_ref, but OpenRLHF passes"),
    ("entropy", STEP_OF_4 + ("--actor.entropy_coef", "0.01"),
     "objective 'entropy' reads the entropy H and writes its own entropy terms, to which --actor.entropy_coef 0.01 "
     "would add OpenRLHF's bonus a second time: leave --actor.entropy_coef unset (or 0)"),
    ("collision", ["--ds.packing_samples"],
     "objective 'collision' uses sum_π_sq (Σ_v π_v²), but drpo-train computes Σ_v π_v² only on unpacked "
     "samples: turn off --ds.packing_samples"),
    ("group", ["--train.micro_batch_size", "1"],
     "objective 'group' uses group_mean (each prompt's responses whole in one loss call, with their group ids), but "
     "drpo-train shuffles whole prompts into micro-batches of --train.micro_batch_size 1: set it to a multiple of "
     "--rollout.n_samples_per_prompt 2"),
    ("batch", ["--train.batch_size", "6", "--train.micro_batch_size", "4"],
     "objective 'batch' uses batch_mean (the optimizer step's whole batch, in one loss call or through batch_statistics() over its micro-batches), but an "
     "optimizer step of --train.batch_size 6 is not whole micro-batches of --train.micro_batch_size 4 on each of 1 "
     "data-parallel rank: make --train.batch_size a multiple of 4"),
    ("batch", ["--train.micro_batch_size", "4", "--train.dynamic_batch_enable"],
     "objective 'batch' uses batch_mean (the optimizer step's whole batch, in one loss call or through batch_statistics() over its micro-batches), but "
     "--train.dynamic_batch_enable repartitions the micro-batches by length: turn it off"),
])
def test_drpo_train_refuses_at_launch_an_input_its_flags_do_not_give_naming_the_flags(name, flags, message, tmp_path,
                                                                                      capsys):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    with pytest.raises(SystemExit) as exit_:
        openrlhf_args(train_flags(tmp_path, "unused", _objective(tmp_path, name), *flags))
    assert exit_.value.code.startswith(f"drpo-train: error: {message}"), exit_.value.code
    # nothing started: the refusal comes before the analysis' report (and long before Ray)
    assert "trust-region" not in capsys.readouterr().out


@pytest.mark.parametrize("name, refused, flags", [
    ("k3", [], KL_FLAGS), ("group", ["--train.micro_batch_size", "1"], ["--train.micro_batch_size", "2"]),
    # (the defaults: 2 micro-batches a step, whose batch statistics drpo-train takes before the step)
    ("batch", ["--train.batch_size", "6", "--train.micro_batch_size", "4"], []), ("collision", ["--ds.packing_samples"], []),
])
def test_the_flags_a_refusal_names_make_drpo_train_accept_the_objective(name, refused, flags, tmp_path):
    """The same objective refused without the flags and accepted with them: OpenRLHF's args then
    carry the objective's own text to the actors, and the loss built from them reads the input."""
    import json
    from openrlhf_drpo.hosts.openrlhf.actor import build_loss
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    with pytest.raises(SystemExit, match=f"^drpo-train: error: objective '{name}' "):
        openrlhf_args(train_flags(tmp_path, "unused", _objective(tmp_path, name), *refused))
    args = openrlhf_args(train_flags(tmp_path, "unused", _objective(tmp_path, name), *flags))
    spec = json.loads(args.drpo.spec)
    assert spec["source"] == OBJECTIVES[name]
    reads = {"k3": "ref_log_probs", "group": "groups", "batch": "batch", "collision": "sum_pi_sq"}[name]
    assert reads in build_loss(spec).inputs()


def _flat(**changes):
    """drpo-train's flat namespace at parse time, as OpenRLHF 0.11.2's defaults and train_flags set it."""
    flags = {"algo.kl.use_loss": False, "algo.kl.init_coef": 0.01, "ds.packing_samples": False,
             "train.dynamic_batch_enable": False, "ds.ring_attn_size": 1, "ds.tensor_parallel_size": 1,
             "actor.num_nodes": 1, "actor.num_gpus_per_node": 1, "train.micro_batch_size": 4, "train.batch_size": 4,
             "rollout.n_samples_per_prompt": 2, "rollout.batch_size": 2, "rollout.micro_batch_size": 1}
    flags.update({k.replace("__", "."): v for k, v in changes.items()})
    return types.SimpleNamespace(**flags)


@pytest.mark.parametrize("changes, key, expected", [
    ({"actor__num_gpus_per_node": 2, "train__micro_batch_size": 2}, "groups",
     "each rank receives whole rollout micro-batches: set --rollout.micro_batch_size to a multiple of "
     "--rollout.n_samples_per_prompt 2, so that each holds whole prompts"),
    ({"actor__num_gpus_per_node": 2, "ds__ring_attn_size": 2}, "batch",
     "drpo-train sums a batch over all ranks as data-parallel ones: set --ds.ring_attn_size 1 and "
     "--ds.tensor_parallel_size 1"),
    ({"actor__num_gpus_per_node": 2}, "batch",
     "an optimizer step of --train.batch_size 4 is not whole micro-batches of --train.micro_batch_size 4 on each of "
     "2 data-parallel ranks: make --train.batch_size a multiple of 8"),
])
def test_on_several_ranks_groups_and_batches_need_whole_shares_per_rank(changes, key, expected):
    from openrlhf_drpo.hosts.openrlhf.inputs import missing_at_launch
    assert missing_at_launch(_flat(**changes))[key] == expected
    # the defaults withhold π_ref (no KL flags) and the top-k support (no --drpo.vocab_topk), nothing else
    assert set(missing_at_launch(_flat())) == {"ref_log_probs", "vocab_log_probs", "vocab_ref_log_probs"}


def test_objectiveloss_called_as_policyloss_refuses_an_input_that_only_drpo_train_supplies():
    import dsl
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    loss = ObjectiveLoss(dsl.parse(OBJECTIVES["k3"], "k3.dsl"))
    x = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"^objective 'k3' uses π_ref, but no reference log-probs were "
                                         r"given \(ref_log_probs=\): drpo-train gives it in ObjectiveLoss.given"):
        loss(x, x.detach(), torch.ones(2, 3), action_mask=torch.ones(2, 3))


def test_group_ids_come_from_the_rollout_index_and_a_split_group_is_refused():
    from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch, split_experience_batch
    from openrlhf_drpo.hosts.openrlhf.inputs import GROUP_KEY, group_ids, tag_groups
    exp = Experience(sequences=torch.ones(6, 3), action_mask=torch.ones(6, 2, dtype=torch.bool),
                     index=[6, 7, 8, 9, 10, 11], info={})
    tag_groups(exp, 2)
    items = split_experience_batch(exp)     # what OpenRLHF's replay buffer keeps: single samples, no index
    assert all(item.index is None for item in items)
    whole = make_experience_batch([items[i] for i in (5, 0, 4, 1)])       # shuffled, groups 5 and 3 whole
    assert group_ids(whole, 2).tolist() == [5, 3, 5, 3] and GROUP_KEY not in whole.info
    split = make_experience_batch([items[i] for i in (0, 1, 2)])
    with pytest.raises(RuntimeError, match=r"a micro-batch holds \[1, 2\] responses of its prompts, not 2 "
                                           r"\(--rollout.n_samples_per_prompt\) each"):
        group_ids(split, 2)


def test_micro_batches_hold_whole_groups_in_a_new_order_each_epoch():
    from openrlhf.trainer.ppo_utils.experience import Experience, split_experience_batch
    from openrlhf_drpo.hosts.openrlhf.inputs import GroupBatches, tag_groups
    exp = Experience(sequences=torch.ones(10, 3), index=list(range(10)), info={})
    tag_groups(exp, 2)
    items = split_experience_batch(exp)
    torch.manual_seed(0)
    batches = GroupBatches(items, 4, shuffle=True)
    epochs = [list(batches) for _ in range(3)]
    assert len(batches) == 2 and all(len(epoch) == 2 for epoch in epochs)      # 5 groups of 2: the fifth dropped
    for epoch in epochs:
        for batch in epoch:
            ids = [i // 2 for i in batch]
            assert len(batch) == 4 and all(ids.count(g) == 2 for g in ids)
    assert len({tuple(map(tuple, epoch)) for epoch in epochs}) > 1       # reshuffled
    assert list(GroupBatches(items, 4, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _run(tiny_model, tmp_path, name, *flags, prepare=None, micro_batches=3, responses=4, observe=None):
    """Three optimizer steps of the real ActorPPOTrainer.ppo_train (DeepSpeed CPU, ZeRO-2), the
    objective installed as the Ray actor installs it; records each loss call's inputs and gradients,
    and what `observe(actor, old, rollouts)` finds at the call (rollouts: what was appended so far)."""
    from openrlhf.utils import get_strategy
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoPolicyModelActor
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    args = openrlhf_args(train_flags(tmp_path / "ckpt", tiny_model, _objective(tmp_path, name), *flags))
    actor = _DrpoPolicyModelActor(1, 0, "127.0.0.1", int(os.environ["MASTER_PORT"]))
    actor.init_model_from_pretrained(get_strategy(args), tiny_model, max_steps=4)
    loss_fn, calls, losses, rollouts = actor.trainer.actor_loss_fn, [], [], []
    forward, backward = loss_fn.forward, actor.trainer.strategy.backward

    def recording_forward(log_probs, old, adv, action_mask=None, **kw):
        given = dict(loss_fn.given)
        out = forward(log_probs, old, adv, action_mask=action_mask, **kw)
        grads = torch.autograd.grad(out[0], [log_probs] + ([given["entropy"]] if "entropy" in given else []),
                                    retain_graph=True)
        calls.append({"log_probs": log_probs.detach(), "old": old, "adv": adv, "mask": action_mask, "loss": out[0],
                      "grads": grads, "kw": kw, "given": given, **(observe(actor, old, rollouts) if observe else {})})
        return out

    def recording_backward(loss, *a, **k):
        losses.append(loss.detach())
        return backward(loss, *a, **k)
    loss_fn.forward, actor.trainer.strategy.backward = recording_forward, recording_backward
    before = [p.detach().clone() for p in actor.actor.model.parameters()]
    for seed in range(3):       # three rollouts of prompts × 2 responses, one optimizer step each
        exp = _experience(actor.tokenizer, actor.actor, seed, B=responses)
        exp.index = list(range(responses))     # each response's place in its rollout, as OpenRLHF's experience maker sets it
        if prepare:
            prepare(exp)
        rollouts.append({"old": exp.action_log_probs.clone(), "sequences": exp.sequences.clone()})
        actor.append(exp)       # as Ray calls it
        status = actor.fit(kl_ctl=0.5)
    assert any(not torch.equal(a.detach(), b) for a, b in zip(actor.actor.model.parameters(), before)), "no change"
    assert len(calls) == micro_batches and all(torch.isfinite(c["loss"]) for c in calls)
    return actor, status, calls, losses


def _per_token_grad(ell, log_probs, mask, kw):
    """An objective's loss gradient to log π by hand: −∂ℓ/∂log π over the step's tokens."""
    n = kw.get("batch_num_tokens") or mask.sum()
    return -torch.autograd.grad(ell.mul(mask).sum(), log_probs)[0] / n * kw.get("dp_size", 1)


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory):
    """The three checks below in one child process, each on an engine of its own (the process's
    start-up once: one_process.checks_in_one_process)."""
    calls = {"reference": ("check_reference", []), "entropy": ("check_entropy", ["entropy", "on"]),
             "grouped": ("check_entropy", ["grouped", "off"])}
    return checks_in_one_process("test_train_v3", {
        name: (function, [tiny_model, str(tmp_path_factory.mktemp(name)), *args]) for name, (function, args) in calls.items()})


def test_drpo_train_gives_the_reference_models_log_probs_as_pi_ref_and_trains_the_objectives_kl(results):
    assert results["reference"]["error"] is None, results["reference"]["error"]


@pytest.mark.parametrize("name", ["entropy", "grouped"])      # chunked log-probs on, and off
def test_drpo_train_gives_h_with_its_gradient_sum_pi_sq_group_ids_and_the_steps_batch(name, results):
    assert results[name]["error"] is None, results[name]["error"]


def check_reference(tiny_model, tmp_path):
    """π_ref is OpenRLHF's base_action_log_probs of each response; the step trains the objective's KL alone."""
    import pathlib
    tmp_path = pathlib.Path(tmp_path)
    def with_reference(exp):
        exp.base_action_log_probs = exp.action_log_probs - 0.2 * torch.rand(exp.action_log_probs.shape,
                                                                            generator=torch.Generator().manual_seed(1))
    refs = []
    _, status, calls, losses = _run(tiny_model, tmp_path, "k3", *KL_FLAGS, *STEP_OF_4,
                                    prepare=lambda e: (with_reference(e), refs.append(e.base_action_log_probs)))
    assert "kl" in status       # OpenRLHF's own KL: logged ...
    rows = torch.cat(refs)
    for call, loss in zip(calls, losses):
        ref = call["given"]["ref_log_probs"]
        # the reference log-probs arrived, each response's own (the replay buffer shuffles them)
        assert all(any(torch.equal(row, other) for other in rows) for row in ref)
        # ... not trained (its coefficient 0.5 passed to fit): the step's loss is the objective's
        assert torch.equal(loss, call["loss"].detach())
        lp = call["log_probs"].double().requires_grad_()
        r, ref_r = torch.exp(lp - call["old"].double()), torch.exp(ref.double() - lp)
        adv = call["adv"].double()
        ell = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv) - 0.04 * (ref_r - torch.log(ref_r) - 1)
        expected = _per_token_grad(ell, lp, call["mask"].double(), call["kw"])
        assert torch.allclose(call["grads"][0].double(), expected, rtol=1e-4, atol=1e-7)


def _rows(old, rollouts):
    """Each row of a loss call: (rollout, response) of the response it is, found by its old
    log-probs (the replay buffer shuffles the rows and keeps no index)."""
    return [next((k, j) for k, e in enumerate(rollouts) for j in range(len(e["old"])) if torch.equal(e["old"][j], row))
            for row in old]


def _by_hand(actor, old, rollouts):
    """Each row's rollout place and its Σ_v π_v² by a softmax written here (float64) over the tiny
    model's own logits for the row's sequence at the call (the update comes after it), not from
    drpo-train's forward or its sum_pi_sq_from_logits."""
    rows = _rows(old, rollouts)
    sequences = torch.stack([rollouts[k]["sequences"][j] for k, j in rows])
    model = getattr(actor.actor.model, "module", actor.actor.model)      # the HF model inside DeepSpeed's engine
    with torch.no_grad():
        logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits.double()
    z = logits[:, :-1][:, -old.shape[1]:] / actor.actor.temperature      # the logits that predict each response token
    p = torch.exp(z - z.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    return {"rows": rows, "sum_pi_sq": (p * p).sum(-1)}


def check_entropy(tiny_model, tmp_path, name, chunked):
    """H is the actor's entropy on the policy's graph, its gradient the objective's; a batch mean
    over the optimizer step's one micro-batch; Σ_v π_v² a fixed input (chunked off: from
    OpenRLHF's logits), equal to one computed here; group ids kept from the rollout index."""
    import pathlib
    tmp_path = pathlib.Path(tmp_path)
    # grouped: rollouts of 4 prompts × 2 responses, micro-batches of 2 prompts' groups (so that group
    # ids ignored or all equal give another baseline), 2 to an optimizer step
    step = STEP_OF_4 if name == "entropy" else ("--rollout.batch_size", "4", "--train.batch_size", "8",
                                                "--train.micro_batch_size", "4")
    actor, status, calls, _ = _run(tiny_model, tmp_path, name, "--drpo.chunked_logprobs", chunked, *step,
                                   micro_batches=3 if name == "entropy" else 6, responses=4 if name == "entropy" else 8,
                                   observe=None if name == "entropy" else _by_hand)
    assert ("drpo_chunk" in vars(actor.actor)) == (chunked == "on")
    for call in calls:
        H = call["given"]["entropy"]
        assert H.requires_grad and H.shape == call["log_probs"].shape       # H on the policy's graph
        mask = call["mask"].double()
        n = call["kw"].get("batch_num_tokens") or mask.sum()
        # the loss's gradient to H is the objective's coefficient 0.01, per token of the step
        assert torch.allclose(call["grads"][1].double(), -0.01 * mask / n, atol=1e-9)
        lp = call["log_probs"].double().requires_grad_()
        r, adv = torch.exp(lp - call["old"].double()), call["adv"].double()
        if name == "entropy":
            batch_mean = (r * mask).sum() / mask.sum()      # the step's whole batch: its one micro-batch
            ell = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv) - 0.05 * batch_mean
        else:
            sq = call["sum_pi_sq"]
            given = call["given"]["sum_pi_sq"]
            assert not given.requires_grad and torch.allclose(given.double(), sq, rtol=1e-5, atol=1e-7)
            # two prompts whole, each response's group its rollout index // 2
            groups = torch.tensor([j // 2 for _, j in call["rows"]])
            assert len(set(groups.tolist())) == 2 and call["given"]["groups"].tolist() == groups.tolist()
            seq_mean = (adv * mask).sum(-1) / mask.sum(-1)

            def ell_of(groups):
                same = (groups[:, None] == groups[None, :]).double()
                baseline = (same @ seq_mean / same.sum(-1))[:, None]       # the mean over the response's group
                ratio = torch.exp(lp - call["old"].double())       # a graph of its own for each
                return ratio * (adv - baseline) - 0.1 * sq * ratio
            ell = ell_of(groups)
            # the case can tell: one group for the whole call would be another gradient
            one_group = _per_token_grad(ell_of(torch.zeros_like(groups)), lp, mask, call["kw"])
            assert not torch.allclose(call["grads"][0].double(), one_group, rtol=1e-4, atol=1e-7)
        assert torch.allclose(call["grads"][0].double(), _per_token_grad(ell, lp, mask, call["kw"]),
                              rtol=1e-4, atol=1e-7)
