"""The host adapters' losses against the hosts' built-in ones, eager, forward + backward, on CPU.

    python3 benchmarks/host_loss_speed.py [--tokens B,T] [--reps N]     # prints JSON

TRL: GRPOTrainer._compute_loss (TRL's own loss code: loss_type dapo, ε 0.2/0.28) against
ObjectiveGRPOTrainer._compute_loss with grpo_clip_higher, both on the same precomputed log-probs
(the model's forward is left out: a harness object hands both the same tensor). verl (in
.venv-verl or $VERL_VENV, which this script runs itself in; skipped, saying so, without it): verl's
get_policy_loss_fn("vanilla") against dsl:ppo_dual_clip at verl's clips, and a few more modes
against their mirrors. Target: each adapter within 1.1x of its host's loss. Ratios are taken side
by side in one run, on one thread, in that thread's CPU time (on a shared machine wall time also
counts other jobs' time slices); the wall-time ratio is given beside it.
benchmarks/loss_speed.py includes this script's result (its --hosts)."""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import types
from pathlib import Path

import torch

from loss_speed import timed     # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]


def side_by_side(pairs, reps):
    """{name: {host_s, ours_s, ratio, wall_ratio}} (CPU seconds; the best of three medians), the
    two timed alternately so load drifts hit both."""
    out = {}
    for name, (host, ours) in pairs.items():
        h, o = [], []
        for _ in range(3):
            h.append(timed(host, reps))
            o.append(timed(ours, reps))
        (host_s, host_wall), (ours_s, ours_wall) = (tuple(map(min, zip(*x))) for x in (h, o))
        out[name] = {"host_s": host_s, "ours_s": ours_s, "ratio": round(ours_s / host_s, 3),
                     "wall_ratio": round(ours_wall / host_wall, 3), "within_1.1x": ours_s / host_s <= 1.1}
    return out


def trl_harnesses(B, T, device="cpu", seed=0):
    """(TRL's GRPOTrainer, ours, their inputs): two stand-ins for a trainer that _compute_loss runs
    on (TRL's loss code: loss_type dapo, ε 0.2/0.28; ours with grpo_clip_higher), whose model
    forward hands back the same log-probs as a fresh leaf (`.lp`) every call, on `device`."""
    from openrlhf_drpo.trl import TrlObjectiveLoss
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.1 * torch.randn(B, T, generator=g)
    mask = (torch.arange(T) < torch.randint(T // 4, T + 1, (B, 1), generator=g)).long()
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": torch.randn(B, generator=g), "old_per_token_logps": old,
              "num_items_in_batch": mask.sum().float()}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    new = new.to(device)

    def harness():
        h = types.SimpleNamespace(
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0,
            loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, use_vllm=False, vllm_importance_sampling_correction=False,
            args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
            model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, aux_loss_enabled=False,
            _entropy_bonus_enabled=False, max_completion_length=T, _metrics={"train": collections.defaultdict(list)},
            accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                              reduce=lambda x, reduction=None: x))
        h.lp = None

        def logps(model, *args, **kwargs):     # the model's forward, left out: the same leaf every call
            h.lp = new.clone().requires_grad_()
            return h.lp, torch.zeros(B, T, device=device), None
        h._get_per_token_logps_and_entropies = logps
        return h

    theirs, ours = harness(), harness()
    ours.objective_loss = TrlObjectiveLoss("grpo_clip_higher")
    return theirs, ours, inputs


def trl_pairs(B, T):
    from trl import GRPOTrainer
    from openrlhf_drpo.trl import ObjectiveGRPOTrainer
    theirs, ours, inputs = trl_harnesses(B, T)

    def step(trainer_cls, h):
        return lambda: trainer_cls._compute_loss(h, None, inputs).backward()
    return {"trl dapo / grpo_clip_higher": (step(GRPOTrainer, theirs), step(ObjectiveGRPOTrainer, ours))}


def verl_pairs(B, T):
    import openrlhf_drpo.verl as adapter
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig
    g = torch.Generator().manual_seed(0)
    mu = torch.rand(B, T, generator=g) * 0.9 + 0.05
    old = mu.log()
    new = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    A = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.arange(T) < torch.randint(T // 4, T + 1, (B, 1), generator=g)
    cases = {  # verl mode: (config, ours)
        "vanilla": (dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28), ("ppo_dual_clip", dict(ε_high=0.28))),
        "cispo": (dict(clip_ratio_low=1.0, clip_ratio_high=0.28), ("cispo", {})),
        "gpg": ({}, ("gpg", {})),
        "dro": (dict(policy_loss=dict(dro_beta=0.05)), ("dro", {})),
        "gspo": (dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), ("gspo", {})),
    }
    pairs = {}
    for mode, (over, (name, params)) in cases.items():
        over = dict(over)
        cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                          policy_loss=PolicyLossConfig(loss_mode=mode, **over.pop("policy_loss", {})), **over)
        ours = adapter.register(name, name=f"bench_{name}", **params)
        # ours with verl's clip settings at their defaults: the objective's parameters replace them
        ours_cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                               policy_loss=PolicyLossConfig(loss_mode=ours))

        def step(loss_mode, cfg=cfg):
            def run():
                lp = new.clone().requires_grad_()
                loss, _ = get_policy_loss_fn(loss_mode)(old_log_prob=old, log_prob=lp, advantages=A, response_mask=mask,
                                                         loss_agg_mode="token-mean", config=cfg)
                loss.backward()
            return run
        pairs[f"verl {mode} / {name}"] = (step(mode), step(ours, ours_cfg))
    return pairs


def measure(B, T, reps):
    """{tokens, threads, trl, verl}: the TRL pairs here, the verl ones in .venv-verl."""
    threads = torch.get_num_threads()
    result = {"tokens": [B, T], "threads": 1, "clock": "thread CPU time", "trl": {"skipped": "trl is not installed"}}
    if importlib.util.find_spec("trl") is not None:
        torch.set_num_threads(1)
        try:
            result["trl"] = side_by_side(trl_pairs(B, T), reps)
        finally:
            torch.set_num_threads(threads)
    venv = Path(os.environ.get("VERL_VENV", ROOT / ".venv-verl")) / "bin" / "python"     # as tests/test_verl.py
    if not venv.exists():
        result["verl"] = {"skipped": f"{venv} is missing (verl cannot share this environment; "
                                     "bash scripts/setup_verl.sh makes its own)"}
        return result
    proc = subprocess.run([str(venv), __file__, "--verl", "--tokens", f"{B},{T}", "--reps", str(reps)],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    result["verl"] = json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--verl", action="store_true", help="(run in .venv-verl by this script) the verl part only")
    a = p.parse_args()
    B, T = map(int, a.tokens.split(","))
    if a.verl:
        torch.set_num_threads(1)
        print(json.dumps(side_by_side(verl_pairs(B, T), a.reps)))
        return
    print(json.dumps(measure(B, T, a.reps), indent=1))


if __name__ == "__main__":
    main()
