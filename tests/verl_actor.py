"""Run by tests/test_verl_inputs.py with the verl venv's python: verl 0.9.1's actor update on CPU
with a tiny random Llama (float64), the parts of it that touch the loss verl's own code: the
trainer's batch (DataProto.to_tensordict, left_right_2_no_padding, _update_actor's settings), the
worker's mini-batches (tu.make_iterator), its FSDP engine's forward_backward_batch (micro-batches
by prepare_micro_batches, forward_step's entropy and log-probs, backward) and the loss the actor
worker binds, partial(ppo_loss, config=actor config). The engine is FSDPEngineWithLMHead without
FSDP (verl registers it for cuda/npu only: its methods run on a bare module, device "cpu").
Each dsl: objective against verl's own term for the same input; prints one JSON line."""
import copy
import functools
import itertools
import json
import os
import sys
import tempfile
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

import openrlhf_drpo.verl as adapter
from dsl import load, parse
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions
from verl.workers.utils import losses as actor_losses
from verl.workers.config import FSDPActorConfig, PolicyLossConfig
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

N, PROMPTS, LP, LR, VOCAB = 4, 4, 3, 6, 23
# an objective that normalises A in its group: verl's GRPO advantage (norm_adv_by_std_in_grpo)
GRPO_NORM = ("S = seq_mean(A)\nadv = (S - group_mean(S))/(group_std(S) + 1e-6)\n"
             "min(r*adv, clip(r, 0.8, 1.2)*adv)\n")


def engine(model):
    """verl's FSDPEngineWithLMHead methods on a bare module: what forward_backward_batch,
    forward_step, prepare_model_inputs and prepare_model_outputs read of the engine."""
    e = object.__new__(transformer_impl.FSDPEngineWithLMHead)
    e.module, e.ulysses_sequence_parallel_size, e.use_ulysses_sp, e.pad_to_length = model, 1, False, None
    e._autocast_dtype, e.scaler = torch.float32, None       # float32: forward_step skips autocast
    e.engine_config = type("EngineConfig", (), dict(entropy_checkpointing=False,
                                                   entropy_from_logits_with_chunking=False))()
    e.get_data_parallel_group, e.get_data_parallel_size = (lambda: None), (lambda: 1)
    e._gradient_sync_context = lambda is_last_micro_batch: nullcontext()
    e.compute_entropy_from_logits = verl_F.entropy_from_logits      # as __init__ sets it, uncompiled
    return e


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).double()


def trainer_batch(eng, seed=0):
    """The trainer's padded batch: left-padded prompts, right-padded responses, rollout.n
    responses per prompt (uid repeated, interleaved as verl's rollout), μ and π_ref near π."""
    g = torch.Generator().manual_seed(seed)
    B = PROMPTS * N
    plen = torch.tensor([3, 2, 3, 1]).repeat_interleave(N)
    rlen = torch.randint(1, LR + 1, (B,), generator=g)
    prompts = torch.randint(1, VOCAB, (B, LP), generator=g) * (torch.arange(LP) >= LP - plen[:, None])
    responses = torch.randint(1, VOCAB, (B, LR), generator=g) * (torch.arange(LR) < rlen[:, None])
    attention = torch.cat([torch.arange(LP) >= LP - plen[:, None], torch.arange(LR) < rlen[:, None]], 1).long()
    batch = DataProto.from_single_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "response_mask": attention[:, LP:]})
    batch.non_tensor_batch["uid"] = np.array([f"p{i // N}" for i in range(B)], dtype=object)
    batch.meta_info["temperature"] = 1.0
    mask = batch.batch["response_mask"].bool()
    logp = forward(eng, batch)[0].detach()
    noise = lambda s: s * torch.randn(B, LR, generator=g, dtype=torch.float64)     # noqa: E731
    batch.batch["old_log_probs"] = torch.where(mask, logp + noise(0.3), 0)
    batch.batch["ref_log_prob"] = torch.where(mask, logp + noise(0.5), 0)
    batch.batch["scores"] = torch.randn(B, generator=g, dtype=torch.float64)
    return batch


def to_td(batch, use_remove_padding=False, **settings):
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, use_fused_kernels=False, **settings)
    return td


def forward(eng, batch):
    """π's log-probs at the responses, through the engine's forward-only pass (as compute_log_prob)."""
    td = to_td(batch, calculate_entropy=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(batch))
    out = eng.forward_backward_batch(td, loss_function=None, forward_only=True)
    return no_padding_2_padding(out["model_output"]["log_probs"], td), td


def actor_config(loss_mode, **over):
    pl = over.pop("policy_loss", {})
    over.setdefault("ppo_micro_batch_size_per_gpu", N)
    return FSDPActorConfig(strategy="fsdp", rollout_n=N, ppo_mini_batch_size=PROMPTS,
                           policy_loss=PolicyLossConfig(loss_mode=loss_mode, **pl), **over)


def update(eng, batch, config, advantages, order=None, use_remove_padding=False):
    """One mini-batch of verl's actor update under `config`: the loss value and every parameter's
    gradient. `order` reorders the batch's rows first (as trainer.balance_batch does)."""
    batch = copy.deepcopy(batch)
    batch.batch["advantages"] = advantages
    if order is not None:
        batch.reorder(torch.tensor(order))
    td = to_td(batch, use_remove_padding, calculate_entropy=config.calculate_entropy or config.entropy_coeff != 0,
               use_dynamic_bsz=config.use_dynamic_bsz, max_token_len_per_gpu=64,
               micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu, global_batch_size=len(batch))
    # as ActorRolloutRefWorker.init_model binds it (engine_workers imports ppo_loss from actor_losses;
    # engine_workers itself needs the rollout server's uvicorn, absent from this venv)
    loss_fn = functools.partial(actor_losses.ppo_loss, config=config)
    eng.module.zero_grad()
    losses = []
    for mini in tu.make_iterator(td, mini_batch_size=len(batch), epochs=1, seed=42,
                                 dataloader_kwargs={"shuffle": config.shuffle}):
        losses += eng.forward_backward_batch(mini, loss_function=loss_fn)["loss"]
    return sum(losses), [p.grad.clone() for p in eng.module.parameters()]


def compare(a, b):
    """max |Δ| of the loss and of every gradient, and the largest gradient entry (scale)."""
    grad = max((x - y).abs().max().item() for x, y in zip(a[1], b[1]))
    return dict(loss_diff=abs(a[0] - b[0]), grad_diff=grad, grad_scale=max(x.abs().max().item() for x in b[1]),
                same=abs(a[0] - b[0]) <= 1e-12 * max(1, abs(b[0])) and grad <= 1e-12)


def refusal(call):
    try:
        call()
        return None
    except ValueError as e:
        return str(e)


def main(kl_forms):
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    for name in ("get_device_id", "get_device_name"):       # verl's platform falls back to cuda
        setattr(transformer_impl, name, lambda: "cpu")
    eng = engine(tiny_model())
    batch = trainer_batch(eng)
    mask, uid = batch.batch["response_mask"], batch.non_tensor_batch["uid"]
    scores = batch.batch["scores"]
    rewards = torch.zeros_like(mask, dtype=torch.float64).scatter(1, mask.sum(1, keepdim=True) - 1, scores[:, None])
    grpo_adv, _ = compute_grpo_outcome_advantage(rewards, mask, index=uid)
    raw = scores[:, None] * mask
    no_dual = dict(clip_ratio_c=1e9)       # the shipped objectives here have no dual clip
    out = {"held": {}, "refused": {}}
    for agg in ("token-mean", "seq-mean-token-mean"):
        # grpo_k3 declares @aggregate = seq-mean-token-mean, which verl refuses to replace: held at each agg
        # declared as it (verl's own term is the same under either)
        k3, k3_control = (adapter.register(load("grpo_k3").with_overrides(params, {"aggregate": agg}),
                                           name=f"grpo_k3:{agg}:{tag}") for tag, params in (("", {}), ("β", {"β": 0.05})))
        held = {
            "grpo_k3": (actor_config(k3, loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0),
                        actor_config("vanilla", loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.04,
                                     kl_loss_type="low_var_kl", **no_dual), grpo_adv, grpo_adv),
            "entropy_bonus": (actor_config("dsl:entropy_bonus", loss_agg_mode=agg, calculate_entropy=True),
                              actor_config("vanilla", loss_agg_mode=agg, entropy_coeff=0.01, **no_dual),
                              grpo_adv, grpo_adv),
            "grpo_norm": (actor_config(adapter.register(parse(GRPO_NORM, "grpo_norm.dsl")), loss_agg_mode=agg),
                          actor_config("vanilla", loss_agg_mode=agg, **no_dual), raw, grpo_adv),
            # controls: another coefficient, verl's term left out, no normalization: each differs
            "control_k3": (actor_config(k3_control, loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0),
                           actor_config("vanilla", loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.04,
                                        kl_loss_type="low_var_kl", **no_dual), grpo_adv, grpo_adv),
            "control_entropy": (actor_config("dsl:entropy_bonus", loss_agg_mode=agg, calculate_entropy=True),
                                actor_config("vanilla", loss_agg_mode=agg, **no_dual), grpo_adv, grpo_adv),
            "control_groups": (actor_config("dsl:ppo", loss_agg_mode=agg),
                               actor_config("vanilla", loss_agg_mode=agg, **no_dual), raw, grpo_adv),
        }
        for (name, (ours, verls, a_ours, a_verl)), rmpad in itertools.product(held.items(), (False, True)):
            # verl's packed forward too (use_remove_padding; a bare module attends across the pack)
            out["held"][f"{name}:{agg}" + ":rmpad" * rmpad] = compare(
                update(eng, batch, ours, a_ours, use_remove_padding=rmpad),
                update(eng, batch, verls, a_verl, use_remove_padding=rmpad))
    # entropy_bonus with H's gradient cut: verl's value, not its gradient (H's own term reaches the model)
    cut = adapter.register(parse("min(r*A, clip(r, 0.8, 1.2)*A) + 0.01*sg(H)\n", "entropy_no_grad.dsl"))
    out["held"]["entropy_no_grad"] = compare(update(eng, batch, actor_config(cut, calculate_entropy=True), grpo_adv),
                                             update(eng, batch, actor_config("vanilla", entropy_coeff=0.01, **no_dual),
                                                    grpo_adv))
    # groups whole across two micro-batches of two prompts' responses each
    two = actor_config(held["grpo_norm"][0].policy_loss.loss_mode, ppo_micro_batch_size_per_gpu=2 * N)
    out["held"]["grpo_norm:two_prompts_per_micro_batch"] = compare(
        update(eng, batch, two, raw), update(eng, batch, actor_config("vanilla", **no_dual), grpo_adv))
    mode = held["grpo_norm"][0].policy_loss.loss_mode
    workload = calculate_workload(batch.batch["attention_mask"].sum(-1))
    balanced = sorted(get_seqlen_balanced_partitions(workload, k_partitions=1, equal_size=True)[0],
                      key=lambda i: (workload[i], i))          # ray_trainer._balance_batch with one rank
    cases = {
        "entropy_coeff": (actor_config("dsl:entropy_bonus", calculate_entropy=True, entropy_coeff=0.01), grpo_adv),
        "no_entropy": (actor_config("dsl:entropy_bonus"), grpo_adv),
        "kl_loss_coef": (actor_config("dsl:grpo_k3", use_kl_loss=True, kl_loss_coef=0.001), grpo_adv),
        "shuffle": (actor_config(mode, shuffle=True), raw),
        "dynamic_bsz": (actor_config(mode, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64), raw),
        "micro_batch_size": (actor_config(mode, ppo_micro_batch_size_per_gpu=N // 2), raw),
    }
    for name, (config, adv) in cases.items():
        out["refused"][name] = refusal(lambda: update(eng, batch, config, adv))
    no_ref = copy.deepcopy(batch)
    no_ref.batch.pop("ref_log_prob")
    out["refused"]["no_ref_log_prob"] = refusal(lambda: update(eng, no_ref, actor_config("dsl:grpo_k3"), grpo_adv))
    # a reference without use_kl_loss: verl made it for use_kl_in_reward's penalty in the rewards
    out["refused"]["kl_in_reward"] = refusal(lambda: update(eng, batch, actor_config("dsl:grpo_k3"), grpo_adv))
    out["refused"]["balance_batch"] = refusal(lambda: update(eng, batch, actor_config(mode), raw, order=balanced))
    out["refused"]["not_through_the_actor"] = refusal(lambda: get_policy_loss_fn("dsl:entropy_bonus")(
        old_log_prob=grpo_adv, log_prob=grpo_adv, advantages=grpo_adv, response_mask=mask.bool(),
        config=actor_config("dsl:entropy_bonus")))
    out["refused"]["otb"] = refusal(lambda: get_policy_loss_fn("dsl:otb"))
    # each of verl's kl_loss_type forms (argv: test_verl.py's KL_FORMS, the KL written in the language
    # as the objective -KL) added to PPO's clip = vanilla + kl_loss_coef·kl_penalty(form)
    for form, text in kl_forms.items():
        *defs, expr = text.strip().split("\n")
        mode = adapter.register(parse("\n".join([*defs, f"min(r*A, clip(r, 0.8, 1.2)*A) + 0.04*({expr})\n"]),
                                      f"kl_{form}.dsl"), name=f"kl_{form}")
        out["held"][f"kl:{form}"] = compare(
            update(eng, batch, actor_config(mode, use_kl_loss=True, kl_loss_coef=0), grpo_adv),
            update(eng, batch, actor_config("vanilla", use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type=form,
                                            **no_dual), grpo_adv))
    out["balanced_order"] = balanced
    print(json.dumps(out))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.pop("VERL_USE_EXTERNAL_MODULES", None)
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
