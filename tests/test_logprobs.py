"""drpo-train's policy actor takes log π (and the entropy) from the hidden states, a chunk of
tokens at a time (openrlhf_drpo/hosts/openrlhf/logprobs.py). Through OpenRLHF 0.11.2's own
Actor: its log-probs, entropy and every parameter's gradient equal OpenRLHF's full-logits path
(fp32, to rounding; through DeepSpeed ZeRO-2 and ZeRO-3 in bf16, as drpo-train runs it), and no
tensor with the vocabulary as its last dimension is larger than one chunk."""
import copy
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from openrlhf_drpo.hosts.openrlhf import logprobs
from one_process import checks_in_one_process
from test_train import VOCAB, tiny_model, train_flags  # noqa: F401  (fixtures)

V, B, PROMPT, RESPONSE = 97, 3, 6, 9


def close(got, want, what=""):
    """Equal to fp32 rounding: the chunked path sums the same terms in other orders, so an entry
    may differ by a few ulps of the tensor's largest entry (measured: at most 5e-7 of it)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max()),
                               msg=lambda m: f"{what}: {m}")


def _llama(tied=False, bias=False, vocab=V, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    if bias:        # a head with a bias (tied: the embedding's weight, its own bias)
        head = torch.nn.Linear(32, vocab, bias=True)
        if tied:
            head.weight = model.model.embed_tokens.weight
        model.lm_head = head
    return model


def _actor(model, temperature=1.0, chunk=None):
    """OpenRLHF's Actor around a built model (packing_samples: set by its from-path branch only),
    with the chunked forward when `chunk` is given."""
    from openrlhf.models.actor import Actor
    actor = Actor(model, temperature=temperature)
    actor.packing_samples = False
    if chunk is not None:
        assert "tokens at a time" in logprobs.install(actor, chunk)
    return actor


def _batch(vocab=V, seed=0):
    """Left-padded prompts, responses padded after their end, as OpenRLHF's samples come."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(3, vocab, (B, PROMPT + RESPONSE), generator=g)
    attention = torch.ones_like(sequences)
    attention[0, :2] = 0                   # a short prompt
    attention[1, -3:] = 0                  # a short response
    attention[2, -1:] = 0
    sequences[attention == 0] = 0
    action_mask = attention[:, PROMPT:].bool()
    weights = torch.randn(2, B, RESPONSE, generator=g)
    return sequences, attention, action_mask, weights


def _step(actor, entropy, seed=0):
    """Log-probs, entropy and every parameter's gradient of a loss on both."""
    sequences, attention, action_mask, (w, w_entropy) = _batch(seed=seed)
    log_probs, output = actor(sequences, action_mask, attention_mask=attention, return_output=True,
                              return_entropy=entropy)
    loss = (log_probs * w).sum()
    ent = output.entropy[:, -RESPONSE:] * action_mask if entropy else None
    if entropy:
        loss = loss + (ent * w_entropy).sum()
    names, params = zip(*actor.named_parameters())
    grads = dict(zip(names, torch.autograd.grad(loss, params)))
    return log_probs.detach(), None if ent is None else ent.detach(), grads


# (chunk, tied, head bias, temperature, entropy); B × RESPONSE = 27 tokens are scored
CASES = [(1, False, False, 1.0, False), (5, False, False, 1.0, True), (7, True, False, 0.7, True),
         (4, False, True, 0.7, True), (64, True, True, 1.0, True)]


@pytest.mark.parametrize("chunk, tied, bias, temperature, entropy", CASES)
def test_chunked_log_probs_entropy_and_gradients_equal_openrlhfs_in_fp32(chunk, tied, bias, temperature, entropy):
    model = _llama(tied, bias)
    want = _step(_actor(copy.deepcopy(model), temperature), entropy)
    chunked = _actor(model, temperature, chunk)
    got = _step(chunked, entropy)
    close(got[0], want[0], "log-probs")
    if entropy:
        close(got[1], want[1], "entropy")
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        close(got[2][name], want[2][name], name)
    if tied:
        assert chunked.model.lm_head.weight is chunked.model.model.embed_tokens.weight
    sequences, attention, action_mask, _ = _batch()
    with torch.no_grad():       # as the experience maker asks for the old log-probs
        close(chunked(sequences, action_mask, attention_mask=attention), want[0], "log-probs without grad")


def test_every_positions_log_probs_equal_openrlhfs_when_asked_without_an_action_mask():
    model = _llama()
    sequences, attention, _, _ = _batch()
    want = _actor(copy.deepcopy(model))(sequences, attention_mask=attention, return_logprobs=True)
    got = _actor(model, chunk=4)(sequences, attention_mask=attention, return_logprobs=True)
    assert got.shape == (B, PROMPT + RESPONSE - 1)
    close(got, want, "log-probs")


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor any op allocates (views of its inputs, such as the head's
    weight transposed, are not allocations) whose last dimension is the vocabulary."""
    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk, largest", [(8, 8 * 1000), (None, B * (PROMPT + RESPONSE) * 1000)])
def test_the_largest_vocabulary_sized_tensor_of_a_training_step_is_one_chunk(chunk, largest):
    """With chunks of 8 tokens, forward and backward never form more than 8 rows of logits;
    OpenRLHF's path (chunk None) forms all B·T rows, which shows the probe sees them."""
    actor = _actor(_llama(vocab=1000), chunk=chunk)
    sequences, attention, action_mask, (w, _) = _batch(vocab=1000)
    with _LargestVocabTensor(1000) as probe:
        log_probs, output = actor(sequences, action_mask, attention_mask=attention, return_output=True,
                                  return_entropy=True)
        ((log_probs * w).sum() + output.entropy[:, -RESPONSE:].sum()).backward()
    assert probe.largest == largest


def _peft_head(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"]))


@pytest.mark.parametrize("change, reason", [
    (lambda actor: setattr(actor, "packing_samples", True), "--ds.packing_samples"),
    (lambda actor: setattr(actor, "is_vlm", True), "a vision-language model"),
    (lambda actor: setattr(actor, "model", _peft_head(actor.model)),
     "the model's LM head is peft.tuners.lora.layer.Linear, not torch.nn.Linear"),
])
def test_a_route_the_chunked_forward_does_not_take_keeps_openrlhfs_forward_and_says_why(change, reason):
    actor = _actor(_llama())
    change(actor)
    note = logprobs.install(actor, 4)
    assert note == f"openrlhf-drpo: log-probs from OpenRLHF's full logits: {reason} (--drpo.chunked_logprobs on)"
    assert "forward" not in actor.__dict__


def test_asked_for_logits_the_chunked_actor_returns_openrlhfs_output():
    model = _llama()
    sequences, attention, _, _ = _batch()
    want = _actor(copy.deepcopy(model))(sequences, attention_mask=attention, return_output=True)
    got = _actor(model, chunk=4)(sequences, attention_mask=attention, return_output=True)
    assert got["logits"].shape == (B, PROMPT + RESPONSE, V)
    close(got["logits"], want["logits"], "logits")


def test_a_model_that_transforms_its_heads_output_falls_back_to_openrlhfs_path_and_says_so(capsys):
    """Gemma 2 soft-caps its logits after the head: what comes back are not the head's log-probs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           final_logit_softcapping=3.0, attn_implementation="eager"))
    want = _step(_actor(copy.deepcopy(model)), entropy=True)
    actor = _actor(model, chunk=4)
    got = _step(actor, entropy=True)
    assert capsys.readouterr().out == ("openrlhf-drpo: Gemma2ForCausalLM transforms its LM head's output; log-probs "
                                       "from OpenRLHF's full logits from now on\n")
    assert actor.drpo_chunk is None
    close(got[0], want[0], "log-probs")
    close(got[1], want[1], "entropy")
    for name in want[2]:
        close(got[2][name], want[2][name], name)


def deepspeed_comparison(model_path, out, *flags) -> dict:
    """drpo-train's policy actor, built by the code Ray runs (DeepSpeed, bf16), with `flags`: the
    forward it has against OpenRLHF's on one micro-batch. Returns its chunk (None: OpenRLHF's
    forward) and the largest differences of the log-probs, the entropy and each parameter's
    full fp32 gradient (relative to its largest entry)."""
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import install_flash_attn_shim
    install_flash_attn_shim()
    from deepspeed.utils import safe_get_full_grad
    from openrlhf.utils import get_strategy
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoPolicyModelActor
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    args = openrlhf_args(train_flags(out, model_path, "drpo", "--actor.entropy_coef", "0.01", "--train.batch_size",
                                     "2", *flags))
    worker = _DrpoPolicyModelActor(1, 0, "127.0.0.1", int(os.environ["MASTER_PORT"]))
    worker.init_model_from_pretrained(get_strategy(args), model_path, max_steps=4)
    actor, A = worker.actor, 7
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(4, len(VOCAB), (4, 12), generator=g)
    attention = torch.ones_like(sequences)
    attention[0, :2] = 0
    action_mask = torch.ones(4, A, dtype=torch.bool)
    action_mask[1, -2:] = False
    w = torch.randn(4, A, generator=g)
    results = []
    for forward in (actor.forward, type(actor).forward.__get__(actor)):
        log_probs, output = forward(sequences, action_mask, attention_mask=attention, return_output=True,
                                    return_entropy=True)
        actor.model.backward((log_probs * w).sum() + (output.entropy[:, -A:] * action_mask).sum())
        grads = {n: safe_get_full_grad(p).clone() for n, p in actor.model.module.named_parameters()}
        actor.model.optimizer.zero_grad()
        results.append((log_probs.detach(), output.entropy[:, -A:].detach() * action_mask, grads))
    (lp, ent, grads), (lp0, ent0, grads0) = results
    return {"chunk": actor.__dict__.get("drpo_chunk"), "log_probs": (lp - lp0).abs().max().item(),
            "entropy": (ent - ent0).abs().max().item(),
            "grads": {n: ((grads[n] - g0).abs().max() / g0.abs().max()).item() for n, g0 in grads0.items()}}


@pytest.fixture(scope="module")
def compared(tiny_model, tmp_path_factory):
    """deepspeed_comparison for each configuration below, in one child process (each on an engine
    of its own, one_process.checks_in_one_process): {name: its result and what it printed}."""
    flags = {"2": ("--ds.zero_stage", "2", "--drpo.logprob_chunk", "5"),
             "3": ("--ds.zero_stage", "3", "--drpo.logprob_chunk", "5"), "off": ("--drpo.chunked_logprobs", "off")}
    results = checks_in_one_process("test_logprobs", {
        name: ("deepspeed_comparison", [tiny_model, str(tmp_path_factory.mktemp(f"stage{name}")), *f])
        for name, f in flags.items()})
    for result in results.values():
        assert result["error"] is None, result["error"]
    return {name: (result["output"], result["value"]) for name, result in results.items()}


@pytest.mark.parametrize("stage", ["2", "3"])
def test_drpo_trains_actor_scores_chunks_by_default_and_equals_openrlhf_under_deepspeed(compared, stage):
    """bf16: the log-probs are the same numbers; the head's gradient, summed over chunks of 5
    tokens from bf16 products, differs by bf16 rounding (measured: 4.6e-3 of its largest entry,
    about one bf16 ulp; every other parameter's gradient is the same)."""
    out, diff = compared[stage]
    assert "openrlhf-drpo: log-probs from the hidden states, 5 tokens at a time (--drpo.chunked_logprobs on)\n" in out
    assert diff["chunk"] == 5
    assert diff["log_probs"] <= 1e-6 and diff["entropy"] <= 1e-5, diff
    assert max(diff["grads"].values()) <= 1e-2, diff


def test_chunked_logprobs_off_keeps_openrlhfs_forward(compared):
    out, diff = compared["off"]
    assert diff["chunk"] is None and "log-probs" not in out


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_chunk_that_is_not_a_positive_number_of_tokens_is_refused(value, tiny_model, tmp_path, capsys):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    with pytest.raises(SystemExit, match="^2$"):
        openrlhf_args(train_flags(tmp_path, tiny_model, "drpo", "--drpo.logprob_chunk", value))
    assert f"argument --drpo.logprob_chunk: a number of tokens (1 or more), not '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("chunk, temperature", [(4, 0.7), (64, 1.0)])
def test_chunked_sum_pi_sq_equals_the_squared_softmax_of_openrlhfs_logits_and_has_no_gradient(chunk, temperature):
    from openrlhf_drpo.hosts.openrlhf.inputs import sum_pi_sq_from_logits
    model = _llama()
    sequences, attention, action_mask, _ = _batch()
    full = _actor(copy.deepcopy(model), temperature)
    _, output = full(sequences, action_mask, attention_mask=attention, return_output=True)
    logits = output["logits"][:, :-1][:, -RESPONSE:].detach()     # fp32, temperature-scaled, as OpenRLHF's
    want = torch.softmax(logits.double(), -1).pow(2).sum(-1).float()
    close(sum_pi_sq_from_logits(logits), want, "Σπ² from the full logits")
    _, output = _actor(model, temperature, chunk)(sequences, action_mask, attention_mask=attention,
                                                   return_output=True, drpo_sum_pi_sq=True)
    assert not output.sum_pi_sq.requires_grad
    close(output.sum_pi_sq, want, "Σπ² in chunks")
