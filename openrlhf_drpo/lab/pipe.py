"""drpo-lab's shared pipeline: one Ray, one vLLM engine and one trainer serve every run of a lab.

`drpo-train --drpo.plugin openrlhf_drpo.lab.pipe --drpo.plugin_config FILE` starts OpenRLHF's
pipeline once, as for a single run; this module is its plugin: drpo-train's named hooks `trainer`
and `rollout_actor` replace OpenRLHF's PPOTrainer (the single controller) by `LabTrainer`, whose
fit() trains each run in FILE in turn, and its vLLM actor by one that seeds each sample. Before each run the policy actor restores the initial weights, optimizer and
scheduler state, its replay buffer and the run's seed and objective (actor.drpo_begin_run), the
prompts are dealt again from the run's seed, and the engine receives the restored weights.

Reproducibility: a run gives the same per-step record inside a lab as alone (in a lab of one):
- vLLM samples with a per-request seed drawn from (run seed, prompt, sample index), not from the
  engine's one generator, whose state would carry over from earlier runs;
- a rollout's samples are put in one order (by prompt and tokens) before training: OpenRLHF
  collects them in the order the engine finishes them, which varies from call to call.

Lab settings (FILE's "stale_k", "engine_int4") model the other sources of off-policyness:
stale engine weights (synced every k steps) and an engine in another precision (4-bit weights).
FILE's "random_reward" replaces each sample's reward by a coin flip drawn from its key alone
(random_reward): a reward independent of the output.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

WEIGHTS_HOOK = "OPENRLHF_DRPO_WEIGHTS_HOOK"     # CPU mode's named hook on the weights an engine receives


def sample_seed(base: int, prompt: str, occurrence: int, index: int) -> int:
    """A sample's seed: fixed by what is sampled, not by when the engine gets to it."""
    text = f"{base}\x00{prompt}\x00{occurrence}\x00{index}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "little")


def random_reward(base: int, prompt: str, occurrence: int, index: int) -> float:
    """The random-reward preset's reward: 0 or 1, drawn from what is sampled (the sample's key) and
    never from what was written, so it is independent of the output and the same on every rerun. A
    hash of its own ("reward"), not the sampling seed: the engine draws the tokens from that one."""
    text = f"reward\x00{base}\x00{prompt}\x00{occurrence}\x00{index}".encode()
    return float(hashlib.sha256(text).digest()[0] & 1)


def int4_weights(weights: dict, group: int = 32) -> dict:
    """The weights a 4-bit engine computes with: every matrix (embeddings and output head too)
    rounded to the nearest of 16 levels, int4 with one scale per `group` weights of a row
    (amax -> 7), as round-to-nearest W4 quantization; vectors (norms) stay as they are.
    (fp8 per tensor on the linear layers alone barely moves this tiny model: its next-word
    distribution lives mostly in the embeddings and the head.)"""
    out = {}
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[1] % group == 0:
            f = w.float().reshape(w.shape[0], -1, group)
            scale = f.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7
            w = ((f / scale).round().clamp(-8, 7) * scale).reshape(w.shape).to(w.dtype)
        out[name] = w
    return out


def rollout_actor(base, config: dict):
    """drpo-train's `rollout_actor` hook: OpenRLHF's (or CPU mode's) vLLM actor, seeded."""
    return _rollout_actor(base, bool(config.get("engine_int4")), bool(config.get("random_reward")))


def _rollout_actor(base, engine_int4: bool, coin_reward: bool = False):
    """The lab's vLLM actor: OpenRLHF's (or CPU mode's) with seeded samples, optionally 4-bit
    weights, and optionally random rewards (the task's own still computed: its target fraction
    stays in the logs)."""
    import copy

    import ray

    class LabRolloutRayActor(base.__ray_actor_class__):
        async def __init__(self, *args, **kwargs):
            if engine_int4:          # read by the worker extension, in the engine's own process
                os.environ[WEIGHTS_HOOK] = f"{__name__}:int4_weights"
            self._drpo_seed, self._drpo_seen = 0, {}
            await super().__init__(*args, **kwargs)

        def drpo_begin_run(self, seed: int) -> None:
            self._drpo_seed, self._drpo_seen = seed, {}

        async def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer,
                                     num_samples=1, images=None):
            import asyncio
            occurrence = self._drpo_seen[prompt] = self._drpo_seen.get(prompt, -1) + 1
            params = []
            for i in range(num_samples):
                p = copy.deepcopy(sampling_params)
                p.seed = sample_seed(self._drpo_seed, prompt, occurrence, i)
                params.append(p)
            # as OpenRLHF's generate_responses, one seeded copy of the sampling parameters per sample
            outputs = await asyncio.gather(*[
                self.executor.execute(prompt=prompt, label=label, sampling_params=p, max_length=max_length,
                                      hf_tokenizer=hf_tokenizer, llm_engine=self, images=images) for p in params])
            if coin_reward:
                for i, out in enumerate(outputs):
                    coin = random_reward(self._drpo_seed, prompt, occurrence, i)
                    out.update(reward=coin, scores=coin)
            return outputs
    return ray.remote(LabRolloutRayActor)


def _floats(status: dict) -> dict:
    out = {}
    for k, v in status.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            pass
    return out


def trainer(base, config: dict):
    """drpo-train's `trainer` hook: OpenRLHF's PPOTrainer Ray actor, whose fit() trains every run of
    the lab file (config) in turn."""
    import ray

    class LabTrainer(base.__ray_actor_class__):
        def fit(self, global_step: int = 0) -> None:
            from openrlhf.trainer.ppo_trainer import prepare_datasets
            from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
            import transformers
            with open(self.args.drpo.plugin_config) as f:
                lab = json.load(f)
            self._stale_k = int(lab.get("stale_k") or 1)
            self.tensorboard_logger = self.wandb_logger = None    # fit() closes them after one run
            for i, run in enumerate(lab["runs"]):
                start = time.time()
                self._run, self._step, self._synced = run, 0, 0
                # what OpenRLHF's trainer keeps across fit() calls starts again: the adaptive KL
                # coefficient (in place: the experience maker holds the same controller) and the
                # best-checkpoint metric
                self.kl_ctl.value = self.args.algo.kl.init_coef
                self.best_eval_metric_value, self._latest_eval_metric_value = float("-inf"), None
                for path in (run["metrics"], run["step_log"]):
                    if os.path.exists(path):
                        os.remove(path)
                # the prompts, dealt again from the run's seed (their order draws on torch's generator)
                transformers.set_seed(run["seed"])
                self.strategy.seed = self.args.train.seed = run["seed"]
                self.prompts_dataloader, self.eval_dataloader, self.max_steps = prepare_datasets(
                    self.strategy, self.tokenizer)
                self.samples_generator = SamplesGenerator(
                    strategy=self.strategy, prompts_dataloader=self.prompts_dataloader,
                    eval_dataloader=self.eval_dataloader, tokenizer=self.tokenizer, vllm_engines=self.vllm_engines)
                ray.get(self.actor_model_group.async_run_method(
                    method_name="drpo_begin_run", spec=run["spec"], step_log=run["step_log"], seed=run["seed"]))
                ray.get([e.drpo_begin_run.remote(run["seed"]) for e in self.vllm_engines])
                super().broadcast_to_vllm()
                print(f"drpo-lab: run {i} started", flush=True)
                super().fit(0)
                with open(run["metrics"], "a") as f:
                    f.write(json.dumps({"wall_s": time.time() - start}) + "\n")
                print(f"drpo-lab: run {i} done", flush=True)

        def train_step(self, rollout_samples, global_step):
            # one order for the samples whatever order the engine finished them in
            rollout_samples = sorted(rollout_samples, key=lambda e: (e.prompts, e.sequences.tolist()))
            self._step = global_step + 1
            return super().train_step(rollout_samples, global_step)

        def broadcast_to_vllm(self) -> None:
            # stale engine: the weights reach it only after every k-th step
            if self._step % self._stale_k == 0:
                super().broadcast_to_vllm()
                self._synced = self._step

        def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
            row = {"step": global_step, **_floats(logs_dict or {}),
                   # the engine's weights after this step are the trainer's after step `engine_weights`
                   "engine_weights": self._synced}
            with open(self._run["metrics"], "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"drpo-lab: run step {global_step} reward {row.get('reward', float('nan')):.4f}", flush=True)
            return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
    return ray.remote(LabTrainer)
