"""A synthetic task that runs the whole drpo-train pipeline on a laptop, built locally.

    python -m openrlhf_drpo.lab.toytask DIR    # writes DIR/model, DIR/prompts.jsonl; prints the flags

The vocabulary is a few dozen words, the policy a randomly initialised tiny Llama, each
prompt a few random words, and the reward the fraction of response words equal to the
prompt's target word (its label), so learning is easy to see: a random policy scores about
1/len(WORDS). This file is also the reward function (`--reward.remote_url` takes it), so it
imports only the standard library and torch at the top.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys

WORDS = [f"w{i}" for i in range(16)]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
TARGET = "w7"


def _response(query: str, prompt: str) -> str:
    return query[len(prompt):] if prompt and query.startswith(prompt) else query


def target_frequency(response: str, target: str) -> float:
    words = response.split()
    return sum(w == target for w in words) / len(words) if words else 0.0


def reward_func(queries, prompts, labels):
    import torch
    rewards = torch.tensor([target_frequency(_response(q, p), str(t)) for q, p, t in zip(queries, prompts, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"target_frequency": rewards}}


def tiny_llama(folder: str, vocab: list[str], seed: int = 0, hidden: int = 128):
    """A randomly initialised tiny Llama (fp32, not saved) and its word-level tokenizer, saved
    in folder/model; returns (model, tokenizer, model folder)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    model_dir = os.path.join(folder, "model")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(model_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config), tok, model_dir


def build(folder: str, prompts: int = 256, prompt_words: int = 4, seed: int = 0, hidden: int = 128) -> dict:
    """Writes a tiny Llama with its word-level tokenizer and a prompt set; returns their paths."""
    import torch
    model, _, model_dir = tiny_llama(folder, SPECIAL + WORDS, seed, hidden)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    rng = random.Random(seed)
    data = os.path.join(folder, "prompts.jsonl")
    with open(data, "w") as f:
        for _ in range(prompts):
            f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(prompt_words)), "target": TARGET}) + "\n")
    return {"model": model_dir, "prompts": data, "reward": os.path.abspath(__file__)}


def flags(task: dict, out: str, steps: int, rollout_prompts: int = 4, samples: int = 4, seed: int = 0,
          lr: float = 5e-3, updates: int = 1) -> list[str]:
    """drpo-train flags for a CPU run of `steps` rollouts on the task, each cut into `updates`
    optimizer steps (1: the train batch is the whole rollout batch); at most as many steps as
    the prompt file has prompts / rollout_prompts."""
    batch = rollout_prompts * samples // updates
    return [
        "--actor.model_name_or_path", task["model"], "--reward.remote_url", task["reward"],
        "--data.prompt_dataset", task["prompts"], "--data.input_key", "prompt", "--data.label_key", "target",
        "--data.max_samples", str(rollout_prompts * steps), "--data.max_len", "64", "--rollout.max_new_tokens", "8",
        "--rollout.batch_size", str(rollout_prompts), "--rollout.n_samples_per_prompt", str(samples),
        "--rollout.micro_batch_size", str(rollout_prompts * samples), "--train.batch_size", str(batch),
        "--train.micro_batch_size", str(batch), "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
        "--vllm.enforce_eager", "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--actor.adam.lr", str(lr),
        "--actor.lr_warmup_ratio", "0", "--train.seed", str(seed), "--rollout.temperature", "1.0",
        "--ckpt.output_dir", os.path.join(out, "ckpt"), "--ckpt.path", os.path.join(out, "ckpt", "checkpoints"),
        "--logger.tensorboard_dir", os.path.join(out, "tensorboard"),
    ]


_STEP = re.compile(r"Global step (\d+): \{(.*)\}")
_ITEM = re.compile(r"'([^']+)': (-?(?:nan|inf|[0-9.]+(?:e[-+]?\d+)?))")


def steps_from_log(text: str) -> list[dict]:
    """OpenRLHF's per-step metrics, from the `Global step N: {...}` lines a run prints (plus "step": N)."""
    steps = {}
    for m in _STEP.finditer(text):
        steps[int(m.group(1))] = {"step": int(m.group(1)), **{k: float(v) for k, v in _ITEM.findall(m.group(2))}}
    return [steps[k] for k in sorted(steps)]


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else "toytask"
    print(" ".join(flags(build(folder), folder, steps=16)))
