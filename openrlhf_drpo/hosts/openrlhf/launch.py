"""Where drpo-train runs, decided before OpenRLHF is imported: CPU or GPU mode (from the Ray
cluster that OpenRLHF's ray.init() would join and its GPUs, else this machine's CUDA), and the
pre-flight checks that turn OpenRLHF's hangs and deep crashes into clear errors."""
from __future__ import annotations

import argparse
import functools
import os
import socket


CPU_MODES = ("auto", "on", "off", "cluster")


def pre_parse(argv: list[str]):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--drpo.cpu_mode", choices=CPU_MODES, default="auto")
    pre.add_argument("--drpo.plugin", default=None)
    pre.add_argument("--drpo.plugin_config", default=None)
    return pre.parse_known_args(argv)[0]


def ray_cluster() -> tuple[str, str] | None:
    """The Ray cluster OpenRLHF's `ray.init()` (no address) joins, and where its address comes
    from; None where it starts a Ray of its own. Ray 2.55 reads RAY_ADDRESS, else the address
    the last `ray start` on this machine recorded (services.get_ray_address_from_environment)."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        return None if address == "local" else (address, "RAY_ADDRESS")
    from ray._private.utils import get_ray_address_file, read_ray_address
    recorded = read_ray_address()
    return (recorded, f"recorded by `ray start` in {get_ray_address_file(None)}") if recorded else None


def _cluster_gpus(address: str, where: str) -> tuple[float, int]:
    """The cluster's GPU count and its number of live nodes: connect, read its resources,
    disconnect. A port nobody listens on is refused here at once, where ray.init would retry
    for minutes."""
    import logging

    import ray
    unreachable = (f"drpo-train: error: no Ray cluster answers at {address} ({where}): start it, point RAY_ADDRESS "
                   f"at one that runs, or use --drpo.cpu_mode on to train on this machine's CPU with a local Ray")
    if address != "auto":       # "auto": any cluster running on this machine, which ray.init finds itself
        host, _, port = address.split("://")[-1].rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError):
            raise SystemExit(unreachable) from None
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError:
        raise SystemExit(unreachable) from None
    try:
        return ray.cluster_resources().get("GPU", 0), sum(node["Alive"] for node in ray.nodes())
    finally:
        ray.shutdown()


def decide_cpu_mode(choice: str) -> tuple[bool, str]:
    """`--drpo.cpu_mode auto|on|off`: whether this run is CPU mode, and the line saying which
    and why. auto never trains on this machine's CPU while a Ray cluster is set up: a job
    submitted from a node without a GPU runs on the cluster's GPUs, or stops if it has none."""
    cluster = ray_cluster()
    if choice == "on":
        replaced = f": a local Ray on this machine replaces the Ray cluster at {cluster[0]} ({cluster[1]})" \
            if cluster else ""
        return True, f"openrlhf-drpo: CPU mode (--drpo.cpu_mode on){replaced}"
    if choice == "off":
        return False, "openrlhf-drpo: GPU mode (--drpo.cpu_mode off)"
    if choice == "cluster":
        return True, _cpu_cluster(cluster)
    if cluster is None:
        import torch
        if not torch.cuda.is_available():
            return True, "openrlhf-drpo: CPU mode: no CUDA device and no Ray cluster (--drpo.cpu_mode auto)"
        n = torch.cuda.device_count()
        return False, (f"openrlhf-drpo: GPU mode: {n} CUDA device{'s' * (n != 1)} on this machine and no Ray "
                       "cluster (--drpo.cpu_mode auto)")
    gpus, _ = _cluster_gpus(*cluster)
    if not gpus:
        raise SystemExit(f"drpo-train: error: the Ray cluster at {cluster[0]} ({cluster[1]}) has no GPU, and "
                         "--drpo.cpu_mode auto does not train on this machine's CPU while a cluster is set up: use a "
                         "cluster with GPUs, or --drpo.cpu_mode on to train on this machine's CPU with a local Ray")
    return False, (f"openrlhf-drpo: GPU mode: the Ray cluster at {cluster[0]} ({cluster[1]}) has {gpus:g} "
                   f"GPU{'s' * (gpus != 1)} (--drpo.cpu_mode auto)")


def _cpu_cluster(cluster) -> str:
    """`--drpo.cpu_mode cluster`: CPU mode on the Ray cluster that is set up, its nodes' CPUs.
    OpenRLHF asks Ray for one GPU per model process, so each node declares logical GPUs
    (`ray start --num-gpus N` on a machine without any), as CPU mode's local Ray does."""
    if cluster is None:
        raise SystemExit("drpo-train: error: --drpo.cpu_mode cluster trains on a Ray cluster and none is set up: "
                         "start one (`ray start --head --num-gpus 1` here, `ray start --address HEAD:6379 --num-gpus 1` "
                         "on the others) or set RAY_ADDRESS, or use --drpo.cpu_mode on for a local Ray")
    gpus, nodes = _cluster_gpus(*cluster)
    if not gpus:
        raise SystemExit(f"drpo-train: error: the Ray cluster at {cluster[0]} ({cluster[1]}) declares no GPU, and "
                         "OpenRLHF asks Ray for one per model process: start its nodes with logical GPUs "
                         "(`ray start --num-gpus 1`; CPU mode uses none of them as CUDA devices)")
    return (f"openrlhf-drpo: CPU mode on the Ray cluster at {cluster[0]} ({cluster[1]}): {nodes} "
            f"node{'s' * (nodes != 1)}, {gpus:g} logical GPU{'s' * (gpus != 1)} (--drpo.cpu_mode cluster)")


def cpu_mode_for(argv: list[str]) -> bool:
    """Decided first, and said on the first line: before OpenRLHF's modules are imported, as
    DeepSpeed picks its accelerator at import."""
    choice = getattr(pre_parse(argv), "drpo.cpu_mode")
    if {"-h", "--help"} & set(argv):     # asks no cluster and says nothing: help is all it prints
        import torch
        return choice in ("on", "cluster") or (choice == "auto" and not torch.cuda.is_available())
    cpu, line = decide_cpu_mode(choice)
    print(line, flush=True)
    return cpu


def code_runtime_env(runtime_env: dict) -> dict:
    """runtime_env plus the packages every worker of a cluster run imports from this driver
    (Ray uploads them once and puts them first on each worker's path): the actors and the
    objective's compiler, the code the driver checked the objective with, whatever another
    node has installed. The objective itself travels as text in the args (train._ship_spec)."""
    import dsl
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))    # openrlhf_drpo/
    mine = [package, os.path.dirname(dsl.__file__)]
    return {**runtime_env, "py_modules": [*runtime_env.get("py_modules", []), *mine],
            "excludes": [*runtime_env.get("excludes", []), "__pycache__"]}


def looks_local(path: str) -> bool:
    # a model-hub id is NAME or ORG/NAME; anything else is a path on this machine
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


# train_ppo_ray flags without a default that works: left out, OpenRLHF 0.11.2 starts Ray and its
# actors and crashes inside one, tens of seconds later (no vLLM engine: an IndexError in the
# rollout); pre-flight names them at once. Flag → what to pass.
REQUIRED = {
    "actor.model_name_or_path": "the policy to train: a Hugging Face model name or a local folder",
    "data.prompt_dataset": "the prompts: a Hugging Face dataset name or a local .jsonl, .json or .parquet file",
    "vllm.num_engines": "the number of vLLM engines, 1 or more: OpenRLHF 0.11.2 generates with vLLM only",
}


def preflight(ns, cpu: bool) -> None:
    """Turn OpenRLHF's hangs and deep crashes into clear errors, before Ray starts."""
    def fail(msg):
        raise SystemExit(f"drpo-train: error: {msg}")

    g = functools.partial(getattr, ns)
    missing = [f"--{flag} ({what})" for flag, what in REQUIRED.items() if not g(flag)]
    if missing:
        fail(f"missing {'; '.join(missing)}")
    paths = lambda key: [p for p in (g(key) or "").split(",") if p]   # noqa: E731  (flags take a,b lists)
    for key in ("actor.model_name_or_path", "reward.model_name_or_path", "critic.model_name_or_path"):
        for path in paths(key):
            if looks_local(path) and not os.path.exists(os.path.expanduser(path)):
                fail(f"--{key} {path}: no such file or directory")
    for path in paths("data.prompt_dataset"):
        if (looks_local(path) or path.endswith((".jsonl", ".json", ".parquet", ".csv"))) \
                and not os.path.exists(os.path.expanduser(path)):
            fail(f"--data.prompt_dataset {path}: no such file or directory")
    if not g("reward.model_name_or_path") and not g("reward.remote_url") and not g("train.agent_func_path"):
        fail("no reward: pass --reward.remote_url (a reward-function .py file or an HTTP URL, e.g. "
             "openrlhf_drpo/hosts/openrlhf/reward.py) or --reward.model_name_or_path")
    for url in paths("reward.remote_url"):
        if url.endswith(".py") and not url.startswith(("http://", "https://")) and not os.path.exists(url):
            fail(f"--reward.remote_url {url}: no such file")
    if cpu:
        return
    import torch
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import gpus_requested
    wanted, present = gpus_requested(ns), torch.cuda.device_count()
    if ray_cluster() is None and wanted > present:
        fail(f"this run asks Ray for {wanted} GPUs and this machine has {present}: lower --actor.num_gpus_per_node, "
             f"--vllm.num_engines and the other *.num_gpus_per_node flags, start a Ray cluster with more GPUs "
             f"(ray start), or use --drpo.cpu_mode on")
