"""drpo-train on a Ray cluster of two nodes, simulated on one machine: no GPU, no download.

    python3 examples/two_node_cpu.py [--steps 2] [--out runs/two_node]

Starts Ray's own test cluster (ray.cluster_utils.Cluster: a head and a second node, two raylets,
each declaring one logical GPU, started without this checkout on their Python path), writes a
user's objective file into a temporary folder, and runs drpo-train on the tiny task of
examples/laptop_quickstart.py with `--drpo.cpu_mode cluster`. One logical GPU per node puts
OpenRLHF's policy and its vLLM engine on different nodes. The objective file is deleted as
soon as the driver has joined the cluster: the workers build the objective from the text the
args carry, and import openrlhf_drpo from the runtime environment the driver shipped. Prints
the run's placement, its steps and its time; the full log is OUT/train.log. Exits 1 unless two
nodes took part, every model process imported the shipped openrlhf_drpo, the objective file was
deleted as the driver joined the cluster (nothing orders that before a worker starts; none reads
it), and every step ran.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not __import__("torch").cuda.is_available():   # building the model imports DeepSpeed, which else
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # says aloud that it found no CUDA
from openrlhf_drpo.lab import toytask  # noqa: E402

# a user's own objective: not a shipped one, in a folder only the driver reads
OBJECTIVE = """# A sequence-level ratio clipped as PPO clips a token's (a user's GSPO with a wider clip).
eps = 0.2
s = exp(seq_mean(log(π) - log(μ)))
min(s*A, clip(s, 1 - eps, 1 + eps)*A)
"""
WHERE = re.compile(r"openrlhf-drpo: (.+) on Ray node ([0-9a-f]+), openrlhf_drpo from (\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")       # Ray colours the prefix of each worker's line
COLUMNS = ("reward", "drpo_ratio_max", "actor_grad_norm")
ROLES = {"vLLM engine", "DeepSpeed model process"}


def placement(log_lines: list[str], nodes: dict[str, str]) -> tuple[list[str], set, bool, set]:
    """From the model processes' own lines: one report line each (its node, named), the nodes
    used, whether each imported openrlhf_drpo from the runtime environment, and the roles seen."""
    placed = [m.groups() for m in map(WHERE.search, log_lines) if m]
    out = [f"{role}: {nodes.get(node, 'a node not in this cluster')} ({node[:12]}), openrlhf_drpo from {folder}"
           for role, node, folder in placed]
    shipped = bool(placed) and all("runtime_resources" in folder for *_, folder in placed)
    return out, {node for _, node, _ in placed}, shipped, {role for role, *_ in placed}


def table(rows: list[dict]) -> list[str]:
    return ["step " + " ".join(f"{c:>15}" for c in COLUMNS)] + \
        [f"{s['step']:>4} " + " ".join(f"{s.get(c, float('nan')):>15.4g}" for c in COLUMNS) for s in rows]


def verdict(used: set, nodes: dict, shipped: bool, roles: set, rows: list[dict], steps: int) -> tuple[str, bool]:
    """The report's last line, and whether the run is what this script exists to show: two
    nodes, each model's process on one of them importing the shipped code, every step."""
    ok = (len(used) == 2 and used <= set(nodes) and shipped and ROLES <= roles
          and [s["step"] for s in rows] == list(range(1, steps + 1)))
    return (f"nodes used: {len(used)} of {len(nodes)}; openrlhf_drpo from the runtime environment in every model "
            f"process: {'yes' if shipped else 'no'}; steps: {len(rows)} of {steps}"), ok


def start_cluster():
    """Two raylets on this machine, each with 2 CPUs and 1 logical GPU, whose workers see none of
    this checkout: no PYTHONPATH in their environment (openrlhf_drpo then comes from the driver's
    runtime environment, or from an installed copy, which the report would show). Ray's files go
    to a folder of this run's (RAY_TMPDIR): the test cluster records its address in, and at
    shutdown deletes, the machine's `ray start` record, which another Ray may own."""
    from ray.cluster_utils import Cluster
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray", dir="/tmp")    # short: Ray's socket paths
    saved = os.environ.pop("PYTHONPATH", None)
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False})
        worker = cluster.add_node(num_cpus=2, num_gpus=1)
        cluster.wait_for_nodes()
    finally:
        if saved is not None:
            os.environ["PYTHONPATH"] = saved
    return cluster, {cluster.head_node.node_id: "head node", worker.node_id: "second node"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=os.path.join("runs", "two_node"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    task = toytask.build(args.out)
    folder = tempfile.mkdtemp(prefix="objective-")
    objective = os.path.join(folder, "my_objective.dsl")
    with open(objective, "w") as f:
        f.write(OBJECTIVE)
    started = time.monotonic()
    cluster, nodes = start_cluster()
    print(f"Ray cluster at {cluster.address}: " + ", ".join(f"{name} {node[:12]}" for node, name in nodes.items()),
          flush=True)
    cmd = [sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", "--drpo.cpu_mode", "cluster",
           "--drpo.objective", objective, "--drpo.anchor", "rollout", *toytask.flags(task, args.out, steps=args.steps)]
    print("RAY_ADDRESS=" + cluster.address + " drpo-train " + " ".join(cmd[3:]), flush=True)
    lines, deleted = [], False
    try:
        with open(os.path.join(args.out, "train.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "RAY_ADDRESS": cluster.address})
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip("\n"))
                if line.startswith(("openrlhf-drpo: CPU mode", "openrlhf-drpo: joining", "drpo-train: error")) \
                        or WHERE.search(line):
                    print(ANSI.sub("", line.rstrip()), flush=True)
                if line.startswith("openrlhf-drpo: joining the Ray cluster") and os.path.exists(objective):
                    os.remove(objective)        # parsed by the driver: no worker may read it
                    deleted = True
                    print(f"(deleted {objective}: the driver has parsed it, no worker has started)", flush=True)
            rc = proc.wait()
    finally:
        cluster.shutdown()
        if os.path.exists(objective):
            os.remove(objective)
        os.rmdir(folder)
    placed, used, shipped, roles = placement(lines, nodes)
    rows = toytask.steps_from_log("\n".join(lines))
    last, ok = verdict(used, nodes, shipped, roles, rows, args.steps)
    print("\n".join([*placed, *table(rows), last]))
    print(f"drpo-train exited with {rc} after {time.monotonic() - started:.0f} s (cluster start included); "
          f"log: {os.path.join(args.out, 'train.log')}", flush=True)
    if rc == 0 and ok and deleted:
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
        return 0
    print("\n".join(lines[-40:]) + f"\n(Ray's logs: {os.environ['RAY_TMPDIR']})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
