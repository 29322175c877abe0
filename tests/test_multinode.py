"""drpo-train on more than one machine (issue 39, item 3): CPU mode on a Ray cluster that is set
up (`--drpo.cpu_mode cluster`), the driver's code shipped to every worker in Ray's runtime
environment, the two-node run recorded in docs/training.md, and which reductions stay exact
under OpenRLHF's sequence parallelism (ring attention) and tensor parallelism. The two-node run
itself (examples/two_node_cpu.py, about a minute) is not run here: the suite's budget has no
room for it; the test below holds the recorded output to the script's own report."""
import argparse
import contextlib
import os
import pathlib
import re
import sys

import pytest

from test_train import _record_ray_start, no_ray_cluster, ray_clusters, train_flags  # noqa: F401  (fixtures)
from test_train_v3 import _flat

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("env, line", [
    ({"RAY_ADDRESS": 2}, "CPU mode on the Ray cluster at {2} (RAY_ADDRESS): 1 node, 2 logical GPUs "
                         "(--drpo.cpu_mode cluster)"),
    ({"record": 2}, "CPU mode on the Ray cluster at {2} (recorded by `ray start` in {record}): 1 node, 2 logical GPUs "
                    "(--drpo.cpu_mode cluster)"),
])
def test_cpu_mode_cluster_trains_on_the_cluster_that_is_set_up_and_says_so(ray_clusters, no_ray_cluster, monkeypatch,
                                                                           tmp_path, env, line):
    from openrlhf_drpo.hosts.openrlhf.launch import decide_cpu_mode
    (where, gpus), = env.items()
    record = _record_ray_start(tmp_path, ray_clusters[gpus]) if where == "record" else None
    if where == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", ray_clusters[gpus])
    assert decide_cpu_mode("cluster") == (True, "openrlhf-drpo: " + line.format(*[ray_clusters.get(g) for g in range(3)],
                                                                                record=record))


@pytest.mark.parametrize("gpus, message", [
    (None, "--drpo.cpu_mode cluster trains on a Ray cluster and none is set up: start one"),
    (0, "the Ray cluster at {0} (RAY_ADDRESS) declares no GPU, and OpenRLHF asks Ray for one per model process: "
        "start its nodes with logical GPUs (`ray start --num-gpus 1`"),
])
def test_cpu_mode_cluster_refuses_no_cluster_and_a_cluster_without_logical_gpus(ray_clusters, no_ray_cluster,
                                                                                monkeypatch, capsys, gpus, message,
                                                                                tmp_path):
    from openrlhf_drpo.hosts.openrlhf import train
    if gpus is not None:
        monkeypatch.setenv("RAY_ADDRESS", ray_clusters[gpus])
    reward = str(ROOT / "openrlhf_drpo" / "hosts" / "openrlhf" / "reward.py")
    with pytest.raises(SystemExit) as exit_:      # a command line without argument errors: those come first
        train.main(["--drpo.cpu_mode", "cluster", "--drpo.objective", "drpo", "--actor.model_name_or_path", "unused",
                    "--reward.remote_url", reward, "--data.prompt_dataset", "unused/prompts", "--vllm.num_engines", "1",
                    "--ckpt.output_dir", str(tmp_path)])
    assert str(exit_.value.code).startswith("drpo-train: error: " + message.format(ray_clusters.get(0))), \
        exit_.value.code
    assert capsys.readouterr().out == ""        # nothing ran, and no mode was announced


@pytest.fixture()
def recorded_init(monkeypatch):
    """ray.init as drpo-train's patches call it, recording its arguments instead of starting Ray."""
    import ray
    calls = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append(k))
    return calls


def _init_in_drpo_train(cpu, mode, address, monkeypatch, tmp_path):
    """Call ray.init() as OpenRLHF's train() does, inside drpo-train's patches, after a parse."""
    import ray
    from openrlhf_drpo.hosts.openrlhf import cpu_mode, train
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))     # CPU mode pops it
    monkeypatch.setattr(cpu_mode, "check_cluster_gpus", lambda ns: None, raising=False)
    with train._patched_openrlhf(lambda ns, cpu: None, cpu):
        parser = argparse.ArgumentParser()
        parser.add_argument("--actor.model_name_or_path")
        for key, value in _flat().__dict__.items():
            parser.add_argument(f"--{key}", default=value)
        for key in ("vllm.num_engines", "ref.num_nodes", "ref.num_gpus_per_node", "critic.num_nodes",
                    "critic.num_gpus_per_node", "reward.num_nodes", "reward.num_gpus_per_node", "vllm.tensor_parallel_size"):
            parser.add_argument(f"--{key}", default=1)
        for key in ("train.colocate_all", "train.colocate_actor_ref", "train.colocate_critic_reward",
                    "train.async_enable", "reward.remote_url", "train.agent_func_path"):
            parser.add_argument(f"--{key}", default=None)
        parser.add_argument("--algo.advantage.estimator", default="group_norm")
        parser.parse_args(["--drpo.cpu_mode", mode])
        ray.init(runtime_env={"env_vars": {"OPENRLHF_OWN": "1"}})


@pytest.mark.parametrize("cpu, mode", [(True, "cluster"), (False, "auto"), (True, "on")])
def test_a_cluster_run_ships_the_drivers_openrlhf_drpo_and_dsl_to_every_worker(cpu, mode, recorded_init, monkeypatch,
                                                                               tmp_path, capsys):
    import dsl
    import openrlhf_drpo
    _init_in_drpo_train(cpu, mode, "192.0.2.7:6379", monkeypatch, tmp_path)
    (kwargs,) = recorded_init
    env = kwargs["runtime_env"]
    assert env["env_vars"]["OPENRLHF_OWN"] == "1"       # OpenRLHF's own runtime env is kept
    if mode == "on":    # a local Ray replaces the cluster, as before: nothing to ship
        assert kwargs["address"] == "local" and "py_modules" not in env
        return
    assert env["py_modules"] == [os.path.dirname(openrlhf_drpo.__file__), os.path.dirname(dsl.__file__)]
    assert "__pycache__" in env["excludes"]
    if cpu:     # joins the cluster (no local Ray, no GPU count of its own), CPU mode's env and hook
        assert kwargs["address"] == "192.0.2.7:6379" and "num_gpus" not in kwargs
        assert env["env_vars"]["OPENRLHF_DRPO_CPU_CLUSTER"] == "1" and env["worker_process_setup_hook"]
    else:       # GPU mode: OpenRLHF's call as it was, plus the code
        assert kwargs == {"runtime_env": env}
    assert "openrlhf-drpo: joining the Ray cluster at 192.0.2.7:6379 (" in capsys.readouterr().out


def test_a_cluster_with_too_few_logical_gpus_is_refused_where_ray_would_wait_forever(monkeypatch):
    import ray
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    ns = argparse.Namespace(**{"actor.num_nodes": 1, "actor.num_gpus_per_node": 1, "vllm.num_engines": 2,
                               "vllm.tensor_parallel_size": 1, "algo.kl.init_coef": 0.0,
                               "algo.advantage.estimator": "group_norm", "reward.remote_url": "r.py",
                               "train.agent_func_path": None, "train.colocate_all": False,
                               "train.colocate_actor_ref": False, "train.colocate_critic_reward": False,
                               "train.async_enable": False})
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 2.0, "CPU": 4.0})
    with pytest.raises(SystemExit, match=r"^drpo-train: error: this run asks Ray for 3 GPUs and the cluster declares "
                                         r"2: start more nodes"):
        cpu_mode.check_cluster_gpus(ns)


# --------------------------------------------------------- sequence and tensor parallelism

# each reduction's scope, and what OpenRLHF 0.11.2 gives a loss call under ring attention
# (--ds.ring_attn_size 2 on 4 processes: 2 data-parallel ranks): log π and H all-gathered over
# the ring group, whole responses; the logits split
RING = {"actor__num_gpus_per_node": 4, "ds__ring_attn_size": 2, "train__micro_batch_size": 2,
        "rollout__micro_batch_size": 2}
PPO = "min(r*A, clip(r, 0.8, 1.2)*A)"


@pytest.mark.parametrize("name, text, refused", [
    ("token", f"{PPO}\n", None),
    ("entropy", f"{PPO} + 0.01*H\n", None),
    ("sequence", "s = exp(seq_mean(log(π) - log(μ)))\nmin(s*A, clip(s, 0.8, 1.2)*A)\n", None),
    ("prefix", "r*A*exp(prefix_mean(log(r)))\n", None),
    ("group", "r*(A - group_mean(seq_mean(A)))\n", None),
    ("batch", "r*A - batch_mean(r)\n", "drpo-train sums a batch over all ranks as data-parallel ones: set "
                                        "--ds.ring_attn_size 1 and --ds.tensor_parallel_size 1"),
    ("collision", f"{PPO} - 0.1*sum_π_sq*r\n", "--ds.ring_attn_size 2 splits each response's logits, which Σ_v π_v² "
                                               "is read from, over the ring group (OpenRLHF gathers only the "
                                               "log-probs and the entropy): set --ds.ring_attn_size 1"),
])
def test_under_ring_attention_only_what_reads_split_logits_or_sums_over_ranks_is_refused(name, text, refused):
    """The parse-time refusal, without Ray: ring attention leaves log π and H whole per response
    (gathered before the loss), so token, sequence, prefix and group reductions stay exact; the
    batch's sum over ranks and Σ_v π_v² (from the logits, which stay split) are refused. The
    ring run itself needs flash-attn and CUDA (CPU mode refuses --ds.ring_attn_size)."""
    import dsl
    from openrlhf_drpo.hosts.openrlhf.inputs import refuse_at_launch
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    loss = ObjectiveLoss(dsl.parse(text, f"{name}.dsl"), compile=False)
    ns = _flat(**RING, algo__kl__use_loss=True)
    context = pytest.raises(SystemExit) if refused else contextlib.nullcontext()
    with context as exit_:
        refuse_at_launch(loss, ns)
    if refused:
        assert exit_.value.code.startswith(f"drpo-train: error: objective '{name}' uses "), exit_.value.code
        assert exit_.value.code.endswith(refused), exit_.value.code


def test_ring_attention_refuses_sum_pi_sq_though_openrlhf_turns_packing_on_only_after_the_check(tmp_path):
    # OpenRLHF sets --ds.packing_samples itself for ring attention, after drpo-train's parse-time check
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    objective = tmp_path / "collision.dsl"
    objective.write_text(f"{PPO} - 0.1*sum_π_sq*r\n")
    with pytest.raises(SystemExit, match=r"^drpo-train: error: objective 'collision' uses sum_π_sq .*--ds.ring_attn_size "
                                         r"2 splits each response's logits"):
        openrlhf_args(train_flags(tmp_path, "unused", str(objective), "--drpo.cpu_mode", "off",
                                  "--actor.num_gpus_per_node", "2", "--ds.ring_attn_size", "2"))


# --------------------------------------------------------- the recorded two-node run

def _recorded_output():
    """docs/training.md's recorded output of examples/two_node_cpu.py (the first text block of its
    multi-node section)."""
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    section = text.split("## More than one machine", 1)[1]
    return re.findall(r"```text\n(.*?)```", section, re.S)[0].splitlines()


def test_the_recorded_two_node_run_is_the_scripts_report_of_its_own_lines():
    """The report's placement lines are what the script makes of the model processes' own lines
    recorded above them; its table and last line are in the script's format, for two nodes,
    the shipped code in every model process, and both steps."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import two_node_cpu
    finally:
        sys.path.pop(0)
    out = _recorded_output()
    short = dict(re.findall(r"(head node|second node) ([0-9a-f]{12})", next(l for l in out if "Ray cluster at" in l)))
    raw = [line for line in out if two_node_cpu.WHERE.search(line)]
    nodes = {m.group(2): name for m in map(two_node_cpu.WHERE.search, raw) for name, prefix in short.items()
             if m.group(2).startswith(prefix)}
    placed, used, shipped, roles = two_node_cpu.placement(raw, nodes)
    header = two_node_cpu.table([])[0]
    steps = [int(line.split()[0]) for line in out[out.index(header) + 1:] if line[:4].strip().isdigit()]
    last, ok = two_node_cpu.verdict(used, nodes, shipped, roles, [{"step": s} for s in steps], steps=2)
    assert ok and steps == [1, 2] and len(set(nodes.values())) == 2, (nodes, steps)
    assert out[out.index(header) - len(placed):out.index(header)] == placed
    assert out[out.index(header) + 3] == last
    assert re.fullmatch(r"drpo-train exited with 0 after \d+ s \(cluster start included\); log: \S+", out[-1])
