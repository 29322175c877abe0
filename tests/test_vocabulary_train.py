"""drpo-train's vocabulary sums (issue 38, item 4): π_ref's top-k scored by the reference actor's own
forward, carried in OpenRLHF's Experience through the policy actor's append and its replay buffer
(split, right padding trimmed, re-batched), and the policy's log-probs on those ids scored in chunks
by the training forward: held in-process, through OpenRLHF 0.11.2's own ActorPPOTrainer.training_step,
to a float64 full-softmax reference on a tiny Llama. A topk_sum objective (the policy's own top-k) is
refused at parse time, before Ray, by name."""
import pathlib
import types

import pytest
import torch

import dsl
from test_logprobs import _actor, _llama
from test_train import train_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
V, B, PROMPT, RESPONSE, K = 97, 3, 6, 9, 5
FLAGS = ("--drpo.vocab_topk", str(K), "--algo.kl.use_loss", "--algo.kl.init_coef", "0.01")
TAIL = ("objective 'opd_topk_tail' uses π_v (the policy's log-probs on each token's top-k support, with their "
        "gradient), but ")


def _sequences(seed=0):
    """Responses right-padded by different amounts (every one by at least one, so the replay buffer's
    re-batched width is below the rollout's); the prompts whole (a float64 Llama's eager attention
    turns a left-padded row into NaN: tests/test_logprobs.py holds left padding, in fp32)."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(3, V, (B, PROMPT + RESPONSE), generator=g)
    attention = torch.ones_like(sequences)
    attention[0, -1:] = 0
    attention[1, -4:] = 0
    attention[2, -2:] = 0
    sequences[attention == 0] = 0
    return sequences, attention, attention[:, PROMPT:].bool()


def _reference_actor(model):
    """drpo-train's reference actor around an OpenRLHF Actor, as its init_model_from_pretrained
    leaves it (the chunked forward installed, --drpo.vocab_topk K), without Ray or DeepSpeed."""
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoReferenceModelActor
    ref = object.__new__(_DrpoReferenceModelActor)
    ref.model, ref.drpo_vocab_topk = _actor(model, chunk=4), K
    return ref


def _full_logp(model, sequences, attention):
    """log-softmax of the full [B, A, V] logits in float64 at the positions predicting each response token."""
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(sequences, attention_mask=attention, position_ids=position_ids).logits
    return logits[:, PROMPT - 1:-1].double().log_softmax(-1)


def test_the_reference_actors_top_k_ids_and_log_probs_equal_a_float64_full_softmax():
    teacher = _llama(seed=1).double()
    sequences, attention, mask = _sequences()
    packed = _reference_actor(teacher).forward(sequences, mask, attention)
    assert packed.shape == (B, RESPONSE, 1 + 2 * K) and packed.dtype == torch.float32 and not packed.requires_grad
    with torch.no_grad():
        full = _full_logp(teacher, sequences, attention)
    top = full.topk(K, -1)
    keep = mask[..., None]
    assert torch.equal(torch.where(keep, packed[..., 1 + K:].long(), 0), torch.where(keep, top.indices, 0))
    torch.testing.assert_close(torch.where(keep, packed[..., 1:1 + K].double(), 0.0),
                               torch.where(keep, top.values, 0.0), rtol=0, atol=2e-6)
    label = full.gather(-1, sequences[:, PROMPT:, None])[..., 0] * mask
    torch.testing.assert_close(packed[..., 0].double(), label, rtol=0, atol=2e-6)


def _trainer(args, model, loss_spec):
    """OpenRLHF's ActorPPOTrainer as drpo-train's policy actor leaves it (the chunked forward, the
    objective installed), over a strategy that only runs the backward (no optimizer step), and its
    real replay buffer (built without CUDA)."""
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoPolicyModelActor, install_objective
    trainer = object.__new__(ActorPPOTrainer)
    buffer = object.__new__(NaiveReplayBuffer)
    buffer.__dict__.update(items=[], limit=0, cpu_offload=False, packing_samples=False, dynamic_batch=False)
    strategy = types.SimpleNamespace(backward=lambda loss, *_: loss.backward(), optimizer_step=lambda *a, **k: None,
                                     get_grad_norm=lambda *_: 0.0, ring_attn_group=None, is_rank_0=lambda: True,
                                     accumulated_gradient=1, args=args)
    trainer.__dict__.update(actor=_actor(model, chunk=4), strategy=strategy, args=args, replay_buffer=buffer,
                            actor_scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]), ema_model=None,
                            aux_loss=False, actor_optim=None)
    policy = object.__new__(_DrpoPolicyModelActor)
    policy.trainer, policy.drpo_loss = trainer, install_objective(trainer, loss_spec)
    return policy


def _tail_kl(student, teacher):
    """verl #7855's tail-aware forward KL per token from the two full softmaxes (float64), on the
    teacher's top-k: independent of the compiled code, the support kernel and the host's plumbing."""
    support = teacher.topk(K, -1).indices
    lp, lq = teacher.gather(-1, support), student.gather(-1, support)
    P, Q = lp.exp().sum(-1), lq.exp().sum(-1)
    return (lp.exp() * (lp - lq)).sum(-1) + (1 - P) * ((1 - P).log() - (1 - Q).log())


def test_the_actors_training_step_gives_autograd_s_gradient_through_the_full_softmax(tmp_path):
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf_drpo.hosts.openrlhf.train import objective_spec, openrlhf_args
    args = openrlhf_args(train_flags(tmp_path, "unused", "opd_topk_tail", *FLAGS))
    student, teacher = _llama(seed=0).double(), _llama(seed=1).double()
    sequences, attention, mask = _sequences()
    packed = _reference_actor(teacher).forward(sequences, mask, attention)
    with torch.no_grad():
        old = _actor(student)(sequences, mask, attention_mask=attention).float()
    policy = _trainer(args, student, objective_spec(dsl.load("opd_topk_tail")))
    zeros = torch.zeros(B, RESPONSE)
    policy.append(Experience(sequences=sequences, attention_mask=attention, action_mask=mask, action_log_probs=old,
                             base_action_log_probs=packed, advantages=zeros, returns=zeros, rewards=torch.zeros(B),
                             response_length=mask.sum(-1).float(), total_length=attention.sum(-1).float(), info={}))
    buffer = policy.trainer.replay_buffer
    batch = buffer.collate_fn(buffer.items)         # split, trimmed of right padding, re-batched
    width = batch.action_mask.shape[1]
    assert width < RESPONSE and batch.base_action_log_probs.shape == (B, width)
    n = float(batch.action_mask.sum())
    # kl_ctl 0.5: OpenRLHF's own KL loss would add to the gradient, were it trained beside the objective
    status = policy.trainer.training_step(batch, 0.5, 0, {"dp_size": 1, "batch_num_tokens": n,
                                                          "global_batch_size": float(B)})
    assert "drpo_vocab_ids" not in status["metrics"] and "drpo_vocab_ref" not in status["metrics"]
    names, params = zip(*student.named_parameters())
    got = [p.grad for p in params]

    reference = _llama(seed=0).double()
    full_student = _full_logp(reference, sequences, attention)
    with torch.no_grad():
        full_teacher = _full_logp(teacher, sequences, attention)
    want_loss = torch.where(mask, _tail_kl(full_student, full_teacher), 0.0).sum() / n
    want = torch.autograd.grad(want_loss, list(reference.parameters()))
    torch.testing.assert_close(float(status["metrics"]["policy_loss"]), float(want_loss), rtol=1e-5, atol=0)
    for name, g, w in zip(names, got, want):
        assert g is not None, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("objective, flags, message", [
    ("opd_reverse_topk", FLAGS, "objective 'opd_reverse_topk' uses π_v (the policy's log-probs on each token's top-k "
     "support, with their gradient), but drpo-train gives π_ref's top-k only (ref_topk_sum): topk_sum sums over the "
     "current policy's top-k"),
    ("opd_topk_tail", FLAGS[2:], TAIL + "the support's size k is the command line's: set --drpo.vocab_topk K"),
    ("opd_topk_tail", FLAGS[:2], TAIL + "π_ref's top-k comes from OpenRLHF's reference model"),
    ("opd_topk_tail", FLAGS + ("--ds.packing_samples",), TAIL + "--ds.packing_samples True: drpo-train scores"),
    ("opd_topk_tail", FLAGS + ("--train.dynamic_batch_enable",),
     TAIL + "--train.dynamic_batch_enable True: drpo-train scores the support"),
    ("opd_topk_tail", FLAGS + ("--ds.ring_attn_size", "2"), TAIL + "--ds.ring_attn_size 2: drpo-train scores the support"),
    ("opd_topk_tail", FLAGS + ("--ds.tensor_parallel_size", "2"),
     TAIL + "--ds.tensor_parallel_size 2: drpo-train scores the support"),
    ("opd_topk_tail", FLAGS + ("--drpo.chunked_logprobs", "off"),
     TAIL + "drpo-train scores the support from the hidden states"),
    ("drpo", ("--drpo.vocab_topk", "4"), "--drpo.vocab_topk: objective 'drpo' has no vocabulary sum"),
    ("drpo", ("--drpo.teacher", "org/teacher"), "--drpo.teacher: objective 'drpo' reads neither π_ref nor its top-k"),
])
def test_drpo_train_refuses_a_vocabulary_sum_it_cannot_give_at_parse_time_naming_why(objective, flags, message,
                                                                                     tmp_path, capsys):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    with pytest.raises(SystemExit) as exit_:
        openrlhf_args(train_flags(tmp_path, "unused", str(ROOT / "examples" / f"{objective}.dsl")
                                  if objective == "opd_reverse_topk" else objective, *flags))
    assert exit_.value.code.startswith(f"drpo-train: error: {message}"), exit_.value.code
    assert "starting a local Ray" not in capsys.readouterr().out       # refused while OpenRLHF parses its flags


def test_the_flags_the_refusals_name_make_drpo_train_ship_the_top_k_to_its_actors(tmp_path):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    args = openrlhf_args(train_flags(tmp_path, "unused", "opd_topk_tail", *FLAGS, "--drpo.teacher", "org/teacher"))
    assert (args.drpo.vocab_topk, args.drpo.teacher, args.algo.kl.use_loss) == (K, "org/teacher", True)



def test_an_id_outside_the_policys_vocabulary_is_refused_at_the_loss_call_naming_it():
    from openrlhf_drpo.hosts.openrlhf.support import policy_support
    head, hidden = torch.nn.Linear(8, V, bias=False), torch.zeros(1, 2, 8)
    ids = torch.tensor([[[0, 1], [V, 2]]])
    with pytest.raises(RuntimeError, match=rf"π_ref's top-k holds the id {V}, outside the policy's vocabulary of {V}"):
        policy_support(types.SimpleNamespace(temperature=1.0, drpo_chunk=4), ids)(hidden, head)


def test_a_teacher_is_loaded_in_pi_refs_place_only_with_the_policys_tokenizer(tmp_path, monkeypatch):
    from openrlhf.trainer.ray.launcher import ReferenceModelActor
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoReferenceModelActor
    from openrlhf_drpo.lab.toytask import tiny_llama
    words = ["<pad>", "<s>", "</s>", "<unk>", *[f"w{i}" for i in range(8)]]
    policy = tiny_llama(str(tmp_path / "policy"), words)[2]
    same = tiny_llama(str(tmp_path / "same"), words)[2]
    other = tiny_llama(str(tmp_path / "other"), words[:-1] + ["x7"])[2]      # as many tokens, one other
    loaded = []
    monkeypatch.setattr(ReferenceModelActor.__ray_actor_class__, "init_model_from_pretrained",
                        lambda self, strategy, pretrain: loaded.append(pretrain))
    strategy = types.SimpleNamespace(args=types.SimpleNamespace(drpo=types.SimpleNamespace(teacher=same)),
                                     print=lambda *a: None)
    _DrpoReferenceModelActor.init_model_from_pretrained(object.__new__(_DrpoReferenceModelActor), strategy, policy)
    assert loaded == [same]
    strategy.args.drpo.teacher = other
    with pytest.raises(RuntimeError, match=r"--drpo.teacher .*other/model: its tokenizer is not the policy's"):
        _DrpoReferenceModelActor.init_model_from_pretrained(object.__new__(_DrpoReferenceModelActor), strategy, policy)
    assert loaded == [same]
