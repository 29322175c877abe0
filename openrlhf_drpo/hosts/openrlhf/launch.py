"""drpo-train before OpenRLHF is imported: its --drpo.* flags and --help layout, the errors a
command line shows at once (early_errors: the objective, PolicyLoss's refused flags, the missing
ones), where it runs (CPU or GPU mode, from the Ray cluster that OpenRLHF's ray.init() would join
and its GPUs, else this machine's CUDA), and the pre-flight checks that turn OpenRLHF's hangs and
deep crashes into clear errors."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import socket
import sys
import time


CPU_MODES = ("auto", "on", "off", "cluster")
DRPO_GROUP = "openrlhf-drpo: train with a compiled objective"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a number of tokens (1 or more), not {text!r}")
    return int(text)


def add_drpo_flags(parser: argparse.ArgumentParser) -> None:
    from openrlhf_drpo.hosts.openrlhf.logprobs import CHUNK
    group = parser.add_argument_group(DRPO_GROUP)
    group.add_argument("--drpo.objective", metavar="FILE_OR_NAME", default=None,
                       help="objective file (.dsl) or shipped name (drpo, ppo, spo, ...) replacing PolicyLoss")
    group.add_argument("--drpo.set", action="append", default=[], metavar="NAME=VALUE",
                       help="override an objective parameter (repeatable)")
    group.add_argument("--drpo.anchor", choices=["old", "rollout"], default=None,
                       help="which log-probs play μ: the trainer's old log-probs or vLLM's rollout log-probs")
    group.add_argument("--drpo.step_log", metavar="FILE", default=None,
                       help="append one JSON line per optimizer step (gradient norm before clipping, the range "
                            "of r, the largest per-token |dl/dlog pi|/|A| and mu there, dead steps): drpo-lab's record")
    group.add_argument("--drpo.plugin", metavar="MODULE", default=None,
                       help="a module whose named hooks replace OpenRLHF's classes: trainer(base, config) for the "
                            "PPOTrainer, rollout_actor(base, config) for the vLLM actor (drpo-lab's shared pipeline: "
                            "openrlhf_drpo.lab.pipe)")
    group.add_argument("--drpo.plugin_config", metavar="FILE", default=None,
                       help="a JSON file the plugin's hooks receive as `config` (and the trainer reads)")
    group.add_argument("--drpo.chunked_logprobs", choices=["on", "off"], default="on",
                       help="the policy's log-probs (and entropy) from its hidden states, a chunk of tokens at a "
                            "time, never forming the [batch, length, vocab] logits (off: OpenRLHF's full logits)")
    group.add_argument("--drpo.logprob_chunk", type=_positive, default=CHUNK, metavar="TOKENS",
                       help="tokens per chunk of --drpo.chunked_logprobs")
    group.add_argument("--drpo.vocab_topk", type=_positive, default=None, metavar="K",
                       help="the support of the objective's vocabulary sums (ref_topk_sum): the K entries π_ref ranks "
                            "highest at each response token, scored by the reference model in chunks")
    group.add_argument("--drpo.teacher", metavar="MODEL", default=None,
                       help="the model π_ref's log-probs (and top-k) come from, in place of the actor's initial "
                            "weights (on-policy distillation; it must share the actor's tokenizer)")
    group.add_argument("--drpo.cpu_mode", choices=CPU_MODES, default="auto",
                       help="run OpenRLHF on CPU (DeepSpeed's CPU accelerator, vLLM's CPU backend, gloo "
                            "weight sync, a local Ray); auto: GPU mode where a Ray cluster is set up (RAY_ADDRESS, "
                            "or `ray start` on this machine) and has GPUs, an error where it has none; without "
                            "a cluster, CPU mode exactly when no CUDA device is visible; cluster: CPU mode on the "
                            "Ray cluster that is set up, whose nodes declare logical GPUs (ray start --num-gpus N)")


def help_layout(parser: argparse.ArgumentParser) -> None:
    """--help (and a parse error's usage): the --drpo.* group first, OpenRLHF's own flags after
    it, and PolicyLoss's flags, which drpo-train refuses, marked so with the objective's equivalent."""
    from openrlhf_drpo.hosts.openrlhf.options import SUPERSEDED, refused_help
    groups = parser._action_groups
    groups.insert(0, groups.pop(next(i for i, g in enumerate(groups) if g.title == DRPO_GROUP)))
    parser._optionals.title = "OpenRLHF's train_ppo_ray options (openrlhf.cli.train_ppo_ray)"
    parser.usage = "%(prog)s --drpo.objective FILE_OR_NAME [--drpo.* ...] [OpenRLHF's train_ppo_ray options ...]"
    for action in parser._actions:
        if action.dest in SUPERSEDED:
            action.help = refused_help(action.dest)


def need_host() -> None:
    """One line where torch or OpenRLHF is not installed (an analyser-only install), not an
    import's traceback."""
    missing = [name for name in ("torch", "openrlhf") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"drpo-train: error: training needs {' and '.join(missing)}, not installed here "
                         "(drpo-analyze needs neither): bash scripts/setup.sh installs torch and OpenRLHF 0.11.2's "
                         "pinned stack (pip install '.[train]' adds torch alone)")


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


def stop_local_ray(grace_s: float = 30.0) -> None:
    """Shut down the Ray this driver started (none when it joined a cluster), then kill those of
    its worker processes, and their descendants, still running `grace_s` later, and say so. Ray's
    shutdown stops the raylet and trusts each worker to exit; on a loaded 2-core machine three
    actors once outlived the run by over a minute, holding its cores."""
    if "ray" not in sys.modules:
        return
    import psutil
    import ray
    from ray._private import ray_constants, worker
    node = worker._global_node
    if node is None:
        return

    def descendants(procs):
        found = set()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                found.update(p.children(recursive=True))
        return found
    # a raylet that already exited may have had its pid reused: not ours to follow
    workers = set()
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
        if info.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                workers |= descendants([psutil.Process(info.process.pid)])
    ray.shutdown(_exiting_interpreter=True)      # as Ray's exit handler: its worker logs get 0.5 s to arrive

    def running(p):      # an orphan's zombie waits for a reaper, not for us
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    deadline = time.monotonic() + grace_s
    while (alive := [p for p in workers if running(p)]) and time.monotonic() < deadline:
        workers |= descendants(alive)       # what a worker starts while it winds down
        time.sleep(0.2)
    killed = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            name = p.name()
            p.kill()
            killed.append(name)
    if killed:
        print(f"openrlhf-drpo: killed {len(killed)} Ray worker processes still running {grace_s:g} s after "
              f"Ray's shutdown: {', '.join(sorted(killed))}", file=sys.stderr, flush=True)


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
    cpu, line = cpu_mode_line(argv)
    if line:
        print(line, flush=True)
    return cpu


def cpu_mode_line(argv: list[str]) -> tuple[bool, str | None]:
    """cpu_mode_for's decision and the line saying it, unsaid: drpo-train says it once the command
    line is accepted, so that an argument error is the first thing printed."""
    choice = getattr(pre_parse(argv), "drpo.cpu_mode")
    if {"-h", "--help"} & set(argv):     # asks no cluster and says nothing: help is all it prints
        import torch
        return choice in ("on", "cluster") or (choice == "auto" and not torch.cuda.is_available()), None
    return decide_cpu_mode(choice)


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


def argument_errors(ns) -> list[str]:
    """What pre-flight finds wrong in the flags themselves (missing, a path that does not exist),
    every one of them: it needs no OpenRLHF, so early_errors runs it on the raw command line too."""
    errors = []
    g = lambda flag: getattr(ns, flag, None)    # noqa: E731
    missing = [f"--{flag} ({what})" for flag, what in REQUIRED.items() if not g(flag)]
    if missing:
        errors.append(f"missing {'; '.join(missing)}")
    paths = lambda key: [p for p in (g(key) or "").split(",") if p]   # noqa: E731  (flags take a,b lists)
    for key in ("actor.model_name_or_path", "reward.model_name_or_path", "critic.model_name_or_path"):
        for path in paths(key):
            if looks_local(path) and not os.path.exists(os.path.expanduser(path)):
                errors.append(f"--{key} {path}: no such file or directory")
    for path in paths("data.prompt_dataset"):
        if (looks_local(path) or path.endswith((".jsonl", ".json", ".parquet", ".csv"))) \
                and not os.path.exists(os.path.expanduser(path)):
            errors.append(f"--data.prompt_dataset {path}: no such file or directory")
    if not g("reward.model_name_or_path") and not g("reward.remote_url") and not g("train.agent_func_path"):
        errors.append("no reward: pass --reward.remote_url (a reward-function .py file or an HTTP URL, e.g. "
                      "openrlhf_drpo/hosts/openrlhf/reward.py) or --reward.model_name_or_path")
    for url in paths("reward.remote_url"):
        if url.endswith(".py") and not url.startswith(("http://", "https://")) and not os.path.exists(url):
            errors.append(f"--reward.remote_url {url}: no such file")
    return [f"drpo-train: error: {e}" for e in errors]


def preflight(ns, cpu: bool) -> None:
    """Turn OpenRLHF's hangs and deep crashes into clear errors, before Ray starts."""
    errors = argument_errors(ns)
    if errors:
        raise SystemExit("\n".join(errors))
    if cpu:
        return
    import torch
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import gpus_requested
    wanted, present = gpus_requested(ns), torch.cuda.device_count()
    if ray_cluster() is None and wanted > present:
        raise SystemExit(f"drpo-train: error: this run asks Ray for {wanted} GPUs and this machine has {present}: "
                         "lower --actor.num_gpus_per_node, --vllm.num_engines and the other *.num_gpus_per_node "
                         "flags, start a Ray cluster with more GPUs (ray start), or use --drpo.cpu_mode on")


# The flags early_errors reads from the raw command line, before OpenRLHF (and its parser) is
# imported, abbreviations resolved as argparse does: tests/test_launch.py holds that no other flag
# of OpenRLHF's is a prefix of one of these, so both parsers read a command line alike.
EARLY_FLAGS = ("drpo.objective", "drpo.set", "drpo.anchor", "actor.model_name_or_path", "reward.model_name_or_path",
               "critic.model_name_or_path", "data.prompt_dataset", "reward.remote_url", "train.agent_func_path",
               "vllm.num_engines")
MISSING_OBJECTIVE = "drpo-train: error: --drpo.objective FILE_OR_NAME is required"


class _Unreadable(Exception):
    """A command line a subset parser cannot read (an ambiguous or valueless flag)."""


def _raise(message):
    raise _Unreadable(message)


def early_errors(argv: list[str]) -> list[str]:
    """Every error drpo-train finds in a command line without OpenRLHF, Ray, vLLM or torch (a
    refusal in well under 2 s: benchmarks/train_refusal.py): the objective and its --drpo.set,
    PolicyLoss's refused flags, the missing flags and paths. All of them, so that one round trip
    shows them all; OpenRLHF's parser checks the rest once it is imported."""
    from dsl import DslError, load
    from dsl.objective import parse_overrides
    from openrlhf_drpo.hosts.openrlhf.options import superseded_message
    parser = argparse.ArgumentParser(add_help=False)
    parser.error = _raise        # no usage printed and no exit: reported with the others
    for flag in EARLY_FLAGS:
        parser.add_argument("--" + flag, action="append" if flag == "drpo.set" else "store",
                            default=[] if flag == "drpo.set" else None)
    try:
        ns = parser.parse_known_args(argv)[0]
        refused = superseded_message(argv)
    except (_Unreadable, ValueError) as e:     # as OpenRLHF's parser, a superset of these, would say
        return [f"drpo-train: error: {e}"]
    errors = []
    name, anchor = getattr(ns, "drpo.objective"), getattr(ns, "drpo.anchor")
    if not name:
        errors.append(MISSING_OBJECTIVE)
    else:
        try:
            options = {"anchor": anchor} if anchor in ("old", "rollout") else {}
            load(name).with_overrides(parse_overrides(getattr(ns, "drpo.set"), "--drpo.set"), options, where="--drpo.set")
        except DslError as e:
            errors.append(e.render())
    if anchor not in (None, "old", "rollout"):     # OpenRLHF's parser would say so only after its import
        errors.append(f"drpo-train: error: argument --drpo.anchor: invalid choice: {anchor!r} (choose from 'old', "
                      f"'rollout')")
    errors += [refused] if refused else []
    engines = getattr(ns, "vllm.num_engines")      # OpenRLHF's type=int: 0 is missing, a non-number its error
    setattr(ns, "vllm.num_engines", int(engines) if (engines or "").strip().isdigit() else engines)
    return errors + argument_errors(ns)
