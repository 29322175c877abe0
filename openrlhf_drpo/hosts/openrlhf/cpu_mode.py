"""CPU mode: OpenRLHF 0.11.2's Ray + DeepSpeed + vLLM pipeline on a machine without CUDA.

Every adaptation lives here, each applied only in the processes that need it:
- driver: `driver_environment` (set before DeepSpeed or vLLM is imported), `check_flags`,
  `ray_init_kwargs` (a local Ray with logical GPUs, or a cluster whose nodes declare them:
  `--drpo.cpu_mode cluster`), and the actor classes below;
- Ray workers: `setup_ray_worker` (the runtime env's setup hook) and `adapt_trainer_process`
  (called by the trainer-side actors before OpenRLHF's code runs);
- the vLLM engine's process: hosts.openrlhf.vllm_worker (gloo, a repacking reload, AMX).
They patch internals of the pinned versions only; `check_versions` refuses any other.
This module imports nothing heavy at the top: `install_flash_attn_shim` runs before torch.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

from openrlhf_drpo.hosts.openrlhf import vllm_worker

PINNED = {"openrlhf": "0.11.2", "vllm": "0.29.0", "deepspeed": "0.19.6"}
ENV_FLAG = "OPENRLHF_DRPO_CPU_MODE"          # "1" in every process of a CPU-mode run
CLUSTER_FLAG = vllm_worker.CLUSTER_FLAG      # "1" in every process of a run on a Ray cluster's CPUs


# ---------------------------------------------------------------- flash_attn (every process)

_FLASH_ATTN = "flash_attn is not installed, and this run calls it through --ds.packing_samples or " \
    "--ds.ring_attn_size: drop those flags (CPU mode never uses them), or install flash-attn on a CUDA machine"


def _absent(*args, **kwargs):
    raise RuntimeError(_FLASH_ATTN)


class FlashAttnShim(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """OpenRLHF imports four names from flash_attn at module level (openrlhf.models); this
    provides exactly those modules, last on sys.meta_path so a real install always wins.
    Anything else (flash_attn.ops, which OpenRLHF tries and falls back from) stays absent."""
    NAMES = {"flash_attn": {}, "flash_attn.utils": {},
             "flash_attn.bert_padding": {"index_first_axis": _absent, "pad_input": _absent, "unpad_input": _absent},
             "flash_attn.utils.distributed": {"all_gather": _absent}}

    def find_spec(self, name, path=None, target=None):
        if name not in self.NAMES:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=name in ("flash_attn", "flash_attn.utils"))

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType):
        module.__dict__.update(self.NAMES[module.__name__])
        if module.__name__ == "flash_attn.bert_padding":
            from einops import rearrange
            module.rearrange = rearrange


def install_flash_attn_shim() -> None:
    if any(isinstance(f, FlashAttnShim) for f in sys.meta_path):
        return
    if importlib.util.find_spec("flash_attn") is None:
        sys.meta_path.append(FlashAttnShim())


# ---------------------------------------------------------------- the driver

def check_versions() -> None:
    from importlib.metadata import PackageNotFoundError, version
    for dist, pinned in PINNED.items():
        try:
            found = version(dist) if dist != "vllm" else __import__("vllm").__version__
        except Exception:      # not installed, or a broken install: either way not the pinned one
            found = None
        if found != pinned:
            raise SystemExit(
                f"drpo-train: error: CPU mode adapts {dist}=={pinned} and found {found or 'none'}; it patches "
                f"internals of the pinned versions only (bash scripts/setup.sh installs them)")


def extensions_dir() -> str:
    """DeepSpeed's JIT cache, one per Python environment: another environment's build of the
    same op name would otherwise overwrite it mid-run and force a rebuild."""
    tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    return os.path.join(os.path.expanduser("~"), ".cache", "openrlhf-drpo", f"torch_extensions-{tag}")


def first_compile_note(directory: str | None = None) -> str | None:
    """One line for the first run in this environment, whose silence would otherwise last the
    ~2 minutes DeepSpeed's JIT build of its CPU ops takes (in the workers, before step 1)."""
    directory = directory or extensions_dir()
    if any(path.endswith(".so") for _, _, files in os.walk(directory) for path in files):
        return None
    return (f"openrlhf-drpo: compiling DeepSpeed's CPU ops into {directory}: about 2 minutes, first run "
            "in this Python environment only")


def driver_environment() -> dict:
    """Set in the driver before DeepSpeed or vLLM is imported, and shipped to every Ray worker.
    Overrides what CPU mode needs, so that a stale value in the shell cannot break a run; the KV
    cache size is the user's to raise, within this machine's memory."""
    return {
        ENV_FLAG: "1",
        "DS_ACCELERATOR": "cpu",                   # DeepSpeed otherwise probes for CUDA and fails
        "TORCH_EXTENSIONS_DIR": extensions_dir(),
        "VLLM_CPU_KVCACHE_SPACE": kv_cache_gib(os.environ.get("VLLM_CPU_KVCACHE_SPACE"))[0],
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",     # pinning threads fights the trainer on a shared box
    }


def kv_cache_gib(value) -> tuple[str, str | None]:
    """vLLM's CPU backend needs a KV cache size in GiB: (the user's, None) if it is a number > 0
    within half of this machine's memory, else ("1", the line drpo-train prints saying what CPU mode
    set and why: a user's value is never replaced without a word)."""
    import psutil
    half = psutil.virtual_memory().total / 2**31
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is not None and 0 < number <= half:
        return str(value), None
    why = ("it was unset" if value is None else f"{value!r} is not a number of GiB > 0" if number is None or
           not number > 0 else f"{value} GiB is more than half of this machine's memory ({half:.0f} GiB)")
    return "1", (f"openrlhf-drpo: CPU mode sets VLLM_CPU_KVCACHE_SPACE=1 (GiB, vLLM's CPU KV cache): {why}; "
                 f"export VLLM_CPU_KVCACHE_SPACE=<GiB, up to {half:.0f}> for a larger model")


def _given(argv: list[str], flag: str) -> bool:
    """Whether the command line sets `flag`, spelled out or abbreviated as argparse allows."""
    return any(a.startswith("--") and len(a.split("=", 1)[0]) > 2 and flag.startswith(a.split("=", 1)[0])
               for a in argv)


REFUSED = {   # flags whose code paths need CUDA, and why
    "vllm.enable_sleep": "offloads to and from GPU memory",
    "ds.enable_sleep": "offloads to and from GPU memory",
    "ds.packing_samples": "needs flash attention",
    "train.dynamic_batch_enable": "turns on packing, which needs flash attention",
    "vllm.sync_with_ray": "uses Ray's collective (NCCL)",
    "train.enable_ema": "averages the EMA model on a CUDA device",
    "ds.load_in_4bit": "quantizes with bitsandbytes on CUDA",
    "ds.use_liger_kernel": "runs Triton kernels",
}


def check_flags(ns, argv: list[str]) -> None:
    """Set the defaults that cannot work on CPU, and refuse what the user set that cannot work
    (ns is OpenRLHF's flat namespace, at parse time)."""
    def refuse(msg):
        raise SystemExit(f"drpo-train: error: CPU mode: {msg} (or force --drpo.cpu_mode off on a CUDA machine)")

    settings = {"ds.attn_implementation": ("eager", "flash attention needs CUDA; use --ds.attn_implementation "
                                           "eager or sdpa", ("eager", "sdpa")),
                "vllm.sync_backend": ("gloo", "NCCL needs CUDA; use --vllm.sync_backend gloo", ("gloo",))}
    for key, (default, msg, ok) in settings.items():
        if not _given(argv, "--" + key):
            setattr(ns, key, default)
        elif getattr(ns, key) not in ok:
            refuse(msg)
    for key, why in REFUSED.items():
        if getattr(ns, key, False):
            refuse(f"--{key} {why}; drop it")
    for key in ("ds.ring_attn_size", "ds.tensor_parallel_size", "vllm.tensor_parallel_size"):
        if getattr(ns, key, 1) != 1:
            refuse(f"--{key} must be 1: CPU mode runs one process per model")
    for role in ("actor", "ref", "critic", "reward"):
        if not _given(argv, f"--{role}.num_gpus_per_node"):    # OpenRLHF's default is 8 processes per model
            setattr(ns, f"{role}.num_gpus_per_node", 1)
        if getattr(ns, f"{role}.num_nodes", 1) != 1:
            refuse(f"--{role}.num_nodes must be 1: CPU mode runs each model's processes on one Ray node")


def gpus_requested(ns) -> int:
    """GPUs OpenRLHF's train() (cli/train_ppo_ray.py) will ask Ray for, from its flat parsed
    namespace: colocated groups share one placement group, an async run gives vLLM its own."""
    g = lambda key: getattr(ns, key)   # noqa: E731
    colocate_all = g("train.colocate_all")
    n = g("actor.num_nodes") * g("actor.num_gpus_per_node")
    if g("algo.kl.init_coef") > 0 and not (colocate_all or g("train.colocate_actor_ref")):
        n += g("ref.num_nodes") * g("ref.num_gpus_per_node")
    if g("vllm.num_engines") and not (colocate_all and not g("train.async_enable")):
        n += g("vllm.num_engines") * g("vllm.tensor_parallel_size")
    critic = g("algo.advantage.estimator") == "gae"
    if critic and not colocate_all:
        n += g("critic.num_nodes") * g("critic.num_gpus_per_node")
    reward_actors = not g("reward.remote_url") and not g("train.agent_func_path")
    if reward_actors and not colocate_all and not (critic and g("train.colocate_critic_reward")):
        n += g("reward.num_nodes") * g("reward.num_gpus_per_node")
    return n


def ray_init_kwargs(kwargs: dict, args, cluster: str | None = None) -> dict:
    """OpenRLHF's own ray.init call, made local, with one logical GPU per bundle it will ask
    for (Ray would otherwise wait forever for GPUs that do not exist), and the CPU-mode
    environment plus the worker setup hook shipped to every worker. With `cluster` (an address:
    --drpo.cpu_mode cluster) it joins that cluster instead, whose nodes declare their own
    logical GPUs (drpo-train adds its code to the runtime env: launch.code_runtime_env)."""
    for stale in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES"):   # Ray checks logical GPUs against the latter
        os.environ.pop(stale, None)
    runtime_env = dict(kwargs.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **driver_environment()}
    runtime_env["worker_process_setup_hook"] = "openrlhf_drpo.hosts.openrlhf.cpu_mode.setup_ray_worker"
    if cluster is not None:
        runtime_env["env_vars"][CLUSTER_FLAG] = "1"
        return {**kwargs, "address": cluster, "runtime_env": runtime_env}
    gpus = gpus_requested(args)
    return {**kwargs, "address": "local", "num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, gpus + 2),
            "include_dashboard": False, "runtime_env": runtime_env}


def check_cluster_gpus(args) -> None:
    """Right after joining a cluster (--drpo.cpu_mode cluster): its logical GPUs cover what
    OpenRLHF will ask for, or Ray would wait forever for the placement groups."""
    import ray
    wanted, present = gpus_requested(args), ray.cluster_resources().get("GPU", 0)
    if wanted > present:
        raise SystemExit(f"drpo-train: error: this run asks Ray for {wanted} GPUs and the cluster declares {present:g}: "
                         "start more nodes, or nodes with more logical GPUs (`ray start --num-gpus N`), or lower "
                         "--vllm.num_engines and the *.num_gpus_per_node flags")


# ---------------------------------------------------------------- Ray workers

def setup_ray_worker() -> None:
    """Ray's worker setup hook: runs before an actor class is unpickled, which imports
    openrlhf.models and with it flash_attn."""
    install_flash_attn_shim()


def active() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


_ADAPTED = False


def adapt_trainer_process() -> None:
    """For the DeepSpeed actors (policy, reference, critic, reward): OpenRLHF calls torch.cuda directly
    throughout its trainer; on CPU these become the CPU device or no-ops."""
    global _ADAPTED
    if _ADAPTED:
        return
    _ADAPTED = True
    vllm_worker.say_where("DeepSpeed model process")
    import torch
    from torch.distributed import device_mesh
    import openrlhf.utils.deepspeed.deepspeed as ds_strategy
    from openrlhf.trainer.ppo_utils import replay_buffer
    from openrlhf.trainer.ray import ppo_actor

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.current_stream = lambda *a, **k: None       # only passed on to the broadcast below
    for name in ("set_device", "synchronize", "empty_cache"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    # DeepspeedStrategy builds its (dp, sp, tp) mesh on "cuda"
    ds_strategy.init_device_mesh = lambda _type, *a, **k: device_mesh.init_device_mesh("cpu", *a, **k)
    # NaiveReplayBuffer formats f"cuda:{current_device()}" for its target device
    original_init = replay_buffer.NaiveReplayBuffer.__init__

    def buffer_init(self, *a, **k):
        torch.cuda.current_device = lambda: 0
        try:
            original_init(self, *a, **k)
        finally:
            torch.cuda.current_device = lambda: cpu
        self.target_device = cpu
    replay_buffer.NaiveReplayBuffer.__init__ = buffer_init
    ds_strategy.DeepspeedStrategy.all_reduce = one_rank_all_reduce(ds_strategy.DeepspeedStrategy.all_reduce)
    # the weight-sync group to vLLM is always NCCL in 0.11.2, whatever --vllm.sync_backend says
    ppo_actor.stateless_init_process_group = lambda host, port, rank, world_size, device: vllm_worker.GlooGroup(
        host, port, rank, world_size)
    per_parameter = ppo_actor.ActorPPOTrainer.broadcast_to_vllm
    ppo_actor.ActorPPOTrainer.broadcast_to_vllm = lambda self: _broadcast_at_once(self, per_parameter)


def one_rank_all_reduce(all_reduce):
    """DeepspeedStrategy.all_reduce without the collective when there is one rank. OpenRLHF
    all-reduces every logged metric after every update, one gloo call each (~90 µs even with
    one rank: about a tenth of a lab's update). With one rank the result is what OpenRLHF
    returns anyway: the tensor itself, or a number through float32."""
    import torch

    @functools.wraps(all_reduce)
    def reduce(self, data, op="mean"):
        if self.world_size != 1:
            return all_reduce(self, data, op)
        if isinstance(data, dict):
            return {k: reduce(self, v, op) for k, v in data.items()}
        return data if isinstance(data, torch.Tensor) else torch.Tensor([data]).item()
    return reduce


def _broadcast_at_once(self, per_parameter) -> None:
    """ActorPPOTrainer.broadcast_to_vllm in one message: OpenRLHF sends each parameter with its
    own Ray call and waits for it, about 4.5 ms a parameter on CPU, where the engine's reload of
    them all takes 10-20 ms (a 40-step lab run spent 5.5 of its 26 s in syncs). Here the
    same parameters go as one flat tensor and one call per engine (OpenRLHF's own way where
    their dtypes differ)."""
    import deepspeed
    import ray
    import torch
    from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync
    args, model = self.strategy.args, self.actor.model.module
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not getattr(self.actor, "is_vlm", False)]
    if len({p.dtype for _, p in params}) != 1:
        return per_parameter(self)
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=args.ds.zero_stage == 3):
        if torch.distributed.get_rank() == 0:
            if getattr(args.vllm, "enable_prefix_caching", False):
                ray.get([e.reset_prefix_cache.remote() for e in self.vllm_engines])
            flat = torch.cat([p.data.reshape(-1) for _, p in params])
            shapes = [tuple(p.ds_shape if args.ds.zero_stage == 3 else p.shape) for _, p in params]
            refs = [e.update_weights_flat.remote([n for n, _ in params], flat.dtype, shapes)
                    for e in self.vllm_engines]
            self._model_update_group.broadcast(flat, src=0)
            ray.get(refs)
    torch_dist_barrier_and_cuda_sync()


def _adapted(actor_class):
    """A DeepSpeed actor (reference, reward, critic) that adapts its process before OpenRLHF's
    code runs in it."""
    import ray

    class Adapted(actor_class.__ray_actor_class__):
        def __init__(self, *args, **kwargs):
            adapt_trainer_process()
            super().__init__(*args, **kwargs)
    Adapted.__name__ = Adapted.__qualname__ = f"Cpu{actor_class.__ray_actor_class__.__name__}"
    return ray.remote(num_gpus=1)(Adapted)


def actor_patches():
    """(module, name, replacement) for the driver's launcher in CPU mode; train_ppo_ray imports
    these names when runpy runs it, inside the patches."""
    from openrlhf.trainer.ray import launcher, ppo_critic, vllm_engine
    return [(vllm_engine, "RolloutRayActor", vllm_worker.rollout_actor()),
            *[(module, name, _adapted(getattr(module, name))) for module, name in
              ((launcher, "ReferenceModelActor"), (launcher, "RewardModelActor"), (ppo_critic, "CriticModelActor"))]]
