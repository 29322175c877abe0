"""drpo-lab's synthetic task, built to stress trust regions; this file is also its reward
function (`--reward.remote_url` takes it), so it imports only the standard library and torch
at the top.

A 128-word vocabulary and a tiny Llama pre-trained (a few seconds, locally) towards a peaked
Zipf distribution in which 16 rare target words have 0.25% each. Each prompt is a few words;
the policy writes an 8-word continuation. The reward is the number of *distinct* target
words in it, divided by 8, so a policy that collapses onto one or two target words is capped
at 0.125 or 0.25: collapse shows in the reward. (A reward of "fraction of target words"
saturated at 1.0 within 6 steps, after which every advantage is 0.)
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile

from openrlhf_drpo.lab.toytask import SPECIAL     # standard library only, like this file

WORDS = [f"w{i}" for i in range(128)]
TARGETS = frozenset(WORDS[-16:])       # the rare words the reward counts
TARGET_MASS = 0.0025                   # each target word's probability before training
ZIPF_EXPONENT = 1.1
RESPONSE_WORDS = 8


def _response(query: str, prompt: str) -> str:
    return query[len(prompt):] if prompt and query.startswith(prompt) else query


def distinct_targets(response: str) -> int:
    return len(set(response.split()) & TARGETS)


def target_fraction(response: str) -> float:
    words = response.split()
    return sum(w in TARGETS for w in words) / len(words) if words else 0.0


def reward_func(queries, prompts, labels):
    import torch
    responses = [_response(q, p) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([distinct_targets(r) / RESPONSE_WORDS for r in responses])
    fraction = torch.tensor([target_fraction(r) for r in responses])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"target_fraction": fraction}}


def word_distribution() -> list[float]:
    """The pre-training distribution over WORDS: Zipf over the common words, TARGET_MASS each
    for the targets."""
    common = [w for w in WORDS if w not in TARGETS]
    zipf = [1 / (k + 1) ** ZIPF_EXPONENT for k in range(len(common))]
    scale = (1 - TARGET_MASS * len(TARGETS)) / sum(zipf)
    p = dict(zip(common, (z * scale for z in zipf)))
    return [p.get(w, TARGET_MASS) for w in WORDS]


CACHE_ENV = "OPENRLHF_DRPO_CACHE"       # where built tasks are kept (default: ~/.cache/openrlhf-drpo)


def cache_key(**settings) -> str:
    """What the built task depends on: its settings, the code that builds it (this file and
    toytask.py) and torch's version (pre-training's numbers are torch's)."""
    import torch
    from openrlhf_drpo.lab import toytask
    sources = [open(f, encoding="utf-8").read() for f in (__file__, toytask.__file__)]
    text = json.dumps([sorted(settings.items()), sources, torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached(pretrain_steps: int = 150) -> tuple[dict, bool]:
    """The task, built once per settings into the cache ($OPENRLHF_DRPO_CACHE, else
    ~/.cache/openrlhf-drpo, under lab-task-KEY) and reused by every lab after: (task, reused).
    Built in a fresh folder then renamed into place, so two labs that start together never read
    a half-written task (the second rename loses, and that lab uses the first's)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "openrlhf-drpo")
    folder = os.path.join(root, f"lab-task-{cache_key(pretrain_steps=pretrain_steps)}")
    record = os.path.join(folder, "task.json")
    if not os.path.exists(record):
        os.makedirs(root, exist_ok=True)
        fresh = tempfile.mkdtemp(prefix="lab-task-building-", dir=root)
        task = build(fresh, pretrain_steps=pretrain_steps)
        with open(os.path.join(fresh, "task.json"), "w") as f:
            json.dump({"target_probability": task["target_probability"]}, f)
        try:
            os.rename(fresh, folder)
        except OSError:          # built meanwhile by another lab
            shutil.rmtree(fresh, ignore_errors=True)
        reused = False
    else:
        reused = True
    with open(record) as f:
        saved = json.load(f)
    return {"model": os.path.join(folder, "model"), "prompts": os.path.join(folder, "prompts.jsonl"),
            "reward": os.path.abspath(__file__), **saved}, reused


def build(folder: str, prompts: int = 512, prompt_words: int = 4, seed: int = 0, pretrain_steps: int = 150,
          hidden: int = 128) -> dict:
    """Writes the pre-trained tiny Llama, its word-level tokenizer and the prompts; returns their
    paths and the pre-trained model's probability of each target word (on the first prompt)."""
    import torch
    from openrlhf_drpo.lab.toytask import tiny_llama
    vocab = SPECIAL + WORDS
    model, tok, model_dir = tiny_llama(folder, vocab, seed, hidden)
    # Pre-training: every next word is drawn from the Zipf distribution whatever came before,
    # so the model learns that unigram distribution (and never to stop: no </s>).
    p = torch.zeros(len(vocab))
    p[len(SPECIAL):] = torch.tensor(word_distribution())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(pretrain_steps):
        words = torch.multinomial(p, 64 * 17, replacement=True, generator=g).view(64, 17)
        batch = torch.cat([torch.ones(64, 1, dtype=torch.long), words], dim=1)      # <s> w w ...
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.to(torch.bfloat16).save_pretrained(model_dir)
    rng = random.Random(seed)
    weights = word_distribution()
    data = os.path.join(folder, "prompts.jsonl")
    with open(data, "w") as f:
        for _ in range(prompts):
            f.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, weights, k=prompt_words)), "target": ""}) + "\n")
    with torch.no_grad():
        probs = model.float()(input_ids=torch.tensor([[1] + tok.encode(WORDS[0]).ids])).logits[0, -1].softmax(-1)
    target_ids = [vocab.index(w) for w in sorted(TARGETS)]
    return {"model": model_dir, "prompts": data, "reward": os.path.abspath(__file__),
            "target_probability": [round(float(probs[i]), 5) for i in target_ids]}
