"""drpo-train on CPU: OpenRLHF's real ActorPPOTrainer.ppo_train with DeepSpeed's CPU
accelerator (ZeRO-2) on a tiny random causal LM, with the objective installed by the same
code the Ray actor runs; the actor class on a local Ray; the command line."""
import copy
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze

VOCAB = ["<pad>", "<s>", "</s>", "<unk>"] + [str(i) for i in range(10)] + list("+-*/=()x? ") + \
    ["What", "is", "the", "answer", "boxed", "{", "}"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A randomly initialised Llama and a word-level tokenizer, built here, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def cpu_environment() -> dict:
    """The environment a CPU-mode Ray worker gets (one rank, a free port); the actor adapts its own
    process to CPU."""
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    return {**cpu_mode.driver_environment(), "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


@pytest.fixture()
def cpu_openrlhf(monkeypatch):
    """cpu_environment(), in this process."""
    for k, v in cpu_environment().items():
        monkeypatch.setenv(k, v)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_flags(out, model, objective="drpo", *extra):
    """Flags for a small run; everything it writes (the objective's report, checkpoints) goes to `out`."""
    reward = os.path.join(os.path.dirname(__file__), "..", "openrlhf_drpo", "hosts", "openrlhf", "reward.py")
    return ["--ckpt.output_dir", str(out), "--ckpt.path", str(out), "--actor.model_name_or_path", model, "--drpo.objective", objective, "--reward.remote_url", reward,
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
            "--ds.attn_implementation", "eager", "--vllm.sync_backend", "gloo", "--ds.zero_stage", "2",
            "--train.batch_size", "4", "--train.micro_batch_size", "2", "--rollout.batch_size", "2",
            "--actor.num_gpus_per_node", "1", "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0",
            "--vllm.num_engines", "1", "--data.prompt_dataset", "unused/prompts", *extra]


def _experience(tokenizer, actor_model, seed=0, B=4, prompt=5, response=7):
    from openrlhf.trainer.ppo_utils.experience import Experience
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(4, len(VOCAB), (B, prompt + response), generator=g)
    attention = torch.ones_like(seqs)
    action_mask = torch.ones(B, response, dtype=torch.bool)
    action_mask[1, -2:] = False
    action_mask[3, -4:] = False
    with torch.no_grad():
        current = actor_model(seqs, action_mask, attention_mask=attention).float()
    old = current + 0.3 * torch.randn(current.shape, generator=g)       # a policy that has moved
    adv = torch.randn(B, 1, generator=g).expand(B, response).clone()
    return Experience(sequences=seqs, attention_mask=attention, action_mask=action_mask,
                      action_log_probs=old, advantages=adv, returns=adv,
                      response_length=action_mask.sum(-1).float(), total_length=attention.sum(-1).float(),
                      rewards=torch.zeros(B), info={})


def test_ppo_train_on_cpu_deepspeed_trains_with_the_installed_objective(tiny_model, cpu_openrlhf, tmp_path):
    from openrlhf.utils import get_strategy
    from openrlhf_drpo.hosts.openrlhf.actor import _DrpoPolicyModelActor
    from openrlhf_drpo.hosts.openrlhf.loss import METRIC_KEYS, ObjectiveLoss
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args

    args = openrlhf_args(train_flags(tmp_path / "ckpt", tiny_model, "drpo", "--drpo.set", "delta=0.2"))
    strategy = get_strategy(args)
    actor = _DrpoPolicyModelActor(1, 0, "127.0.0.1", int(os.environ["MASTER_PORT"]))
    actor.init_model_from_pretrained(strategy, tiny_model, max_steps=4)   # exactly what Ray runs
    loss_fn = actor.trainer.actor_loss_fn
    assert isinstance(loss_fn, ObjectiveLoss) and float(loss_fn.objective.params["delta"]) == 0.2

    calls = []
    forward = loss_fn.forward

    def recording_forward(log_probs, old, adv, action_mask=None, **kw):
        out = forward(log_probs, old, adv, action_mask=action_mask, **kw)
        (grad,) = torch.autograd.grad(out[0], log_probs, retain_graph=True)
        calls.append((log_probs.detach().double(), old.double(), adv.double(), action_mask.double(), grad.double(), kw))
        return out
    monkeypatch_forward = recording_forward
    loss_fn.forward = monkeypatch_forward

    for seed in range(2):
        actor.trainer.replay_buffer.append(_experience(actor.tokenizer, actor.actor, seed))
    before = [p.detach().clone() for p in actor.actor.model.parameters()]
    status = actor.fit()

    after = list(actor.actor.model.parameters())
    assert any(not torch.equal(a.detach(), b) for a, b in zip(after, before)), "no parameter changed"
    assert set(METRIC_KEYS) <= set(status), sorted(status)
    assert all(np.isfinite(status[k]) for k in METRIC_KEYS)
    assert "policy_loss" in status and "ppo_clip_ratio" in status
    # the loss's gradient inside the real training step equals the analysis's weight
    w = analyze(dsl.load("drpo", params={"delta": "0.2"}))["_w"]
    assert len(calls) == 4       # 2 experiences x 4 samples, micro-batches of 2
    for lp, old, adv, mask, grad, kw in calls:
        r = torch.exp(lp - old)
        weight = torch.from_numpy(w(r.numpy(), old.exp().numpy(), adv.numpy()))
        n = kw.get("batch_num_tokens") or mask.sum().item()
        expected = -weight * r * adv * mask / n * kw.get("dp_size", 1)
        assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-7), (grad - expected).abs().max()


@pytest.mark.parametrize("op", ["mean", "max", "sum"])
def test_cpu_modes_one_rank_all_reduce_returns_what_openrlhfs_returns(cpu_openrlhf, monkeypatch, op):
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    openrlhfs = getattr(DeepspeedStrategy.all_reduce, "__wrapped__", DeepspeedStrategy.all_reduce)  # unpatched
    ours = cpu_mode.one_rank_all_reduce(openrlhfs)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    torch.distributed.init_process_group("gloo")
    # a strategy as OpenRLHF's all_reduce sees it (it recurses through self.all_reduce)
    one = type("OneRank", (), {"world_size": torch.distributed.get_world_size(), "all_reduce": openrlhfs})()
    # 0.1 and 1/3 are not float32 numbers: OpenRLHF's answer is their float32 rounding
    data = {"policy_loss": 0.1, "n": 3, "third": 1 / 3, "flag": True, "t": torch.tensor([2.5, -1.0])}
    want = openrlhfs(one, copy.deepcopy(data), op)
    # ours makes no collective at all, and hands back the caller's own tensor, as OpenRLHF does
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("a collective with one rank"))
    given = copy.deepcopy(data)
    got = ours(one, given, op)
    assert want.keys() == got.keys() and got["policy_loss"] != 0.1 and got["t"] is given["t"]
    for k in want:
        assert type(got[k]) is type(want[k]) and torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])), k


def test_the_objective_actor_schedules_on_a_local_ray_and_reports_its_objective(tmp_path):
    import ray
    from openrlhf_drpo.hosts.openrlhf.actor import DrpoPolicyModelActor
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"},
                          "worker_process_setup_hook": "openrlhf_drpo.hosts.openrlhf.cpu_mode.setup_ray_worker"})
    try:
        args = openrlhf_args(train_flags(tmp_path, "unused", "spo", "--drpo.set", "eps=0.3"))
        actor = DrpoPolicyModelActor.options(num_cpus=1, num_gpus=1).remote(1, 0, "127.0.0.1", _free_port())
        info = ray.get(actor.drpo_objective.remote(args.drpo.spec), timeout=300)
    finally:
        ray.shutdown()
    assert info["name"] == "spo" and info["params"] == {"eps": 0.3} and info["loss"] == "ObjectiveLoss"
    assert info["objective"] == "r * A - |A| / (2 * ε) * (r - 1)^2"


_LEFT_RUNNING = """
import subprocess, sys, time
import psutil, ray
from openrlhf_drpo.hosts.openrlhf.launch import stop_local_ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])

@ray.remote
class Spawner:
    def start(self):        # sh forks sleep: Ray stops the worker and its child sh, not sleep
        sh = subprocess.Popen(["sh", "-c", "sleep 300; :"])
        while not psutil.Process(sh.pid).children():
            time.sleep(0.05)
        sleep = psutil.Process(sh.pid).children()[0]
        return sleep.pid, sleep.create_time()

print(*ray.get(Spawner.remote().start.remote()), flush=True)
stop_local_ray(grace_s=5)
"""


def test_the_driver_kills_what_its_local_rays_workers_leave_running_and_says_so():
    import re
    import shutil
    import tempfile
    import psutil
    folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")      # Ray's socket paths fit in 107 characters
    proc = subprocess.Popen([sys.executable, "-c", _LEFT_RUNNING, folder], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        if not line:        # the child failed before its worker started the process
            pytest.fail(proc.communicate(timeout=300)[1][-3000:])
        pid, created = line.split()
        stderr = proc.communicate(timeout=300)[1]
        left, ours = None, False
        deadline = time.monotonic() + 30        # a kill takes effect a moment later on a loaded machine
        while time.monotonic() < deadline:
            try:
                left = psutil.Process(int(pid))
                ours = left.create_time() == float(created) and left.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                left, ours = None, False
            if not ours:
                break
            time.sleep(0.2)
        if ours:
            left.kill()         # (the assert below fails: nothing of the test is left running)
    finally:
        proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    assert proc.returncode == 0, stderr[-3000:]
    # what the driver said it killed, beside the process it left (one run in ~10 under a load of 10+ named
    # ray::Spawner but not sleep: the next failure says which part of the tree was missed)
    assert not ours, (left, [x for x in stderr.splitlines() if x.startswith('openrlhf-drpo:')])
    # (any idle worker still winding down after 5 s is named too)
    assert re.search(r"openrlhf-drpo: killed \d+ Ray worker processes still running 5 s after Ray's shutdown: "
                     r"(.*, )?sleep\b", stderr), stderr[-3000:]


_RAY_HEAD = """
import sys, ray
ray.init(num_cpus=1, num_gpus=int(sys.argv[1]), include_dashboard=False, _temp_dir=sys.argv[2])
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()        # until the test closes it; ray.init's head exits with this process
"""


@pytest.fixture(scope="module")
def ray_clusters():
    """Two real Ray clusters on this machine, one with 2 (logical) GPUs and one with none: {gpus: address}.
    Each is its own process's ray.init head (`ray stop` would stop every Ray on the machine)."""
    import shutil
    import tempfile
    heads = {}
    try:
        for gpus in (2, 0):      # short temp dirs: Ray's socket paths must fit in 107 characters
            folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")
            heads[gpus] = folder, subprocess.Popen([sys.executable, "-c", _RAY_HEAD, str(gpus), folder], text=True,
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.DEVNULL)
        addresses = {gpus: proc.stdout.readline().strip() for gpus, (_, proc) in heads.items()}
        assert all(addresses.values()), f"a Ray head did not start: {addresses}"
        yield addresses
    finally:
        for folder, proc in heads.values():
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture()
def no_ray_cluster(monkeypatch, tmp_path):
    """No RAY_ADDRESS, and a Ray temp dir where no `ray start` has recorded a cluster."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))


def _record_ray_start(tmp_path, address):
    # the file `ray start` writes (Ray 2.55 scripts.py), which ray.init() with no address reads
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)
    return str(tmp_path / "ray" / "ray_current_cluster")


# {0}, {2}: the address of the cluster with that many GPUs; record: a `ray start` record naming it
@pytest.mark.parametrize("choice, env, line", [
    ("auto", {"RAY_ADDRESS": 2}, "GPU mode: the Ray cluster at {2} (RAY_ADDRESS) has 2 GPUs (--drpo.cpu_mode auto)"),
    ("auto", {"record": 2}, "GPU mode: the Ray cluster at {2} (recorded by `ray start` in {record}) has 2 GPUs "
                            "(--drpo.cpu_mode auto)"),
    ("auto", {}, "CPU mode: no CUDA device and no Ray cluster (--drpo.cpu_mode auto)"),
    ("on", {}, "CPU mode (--drpo.cpu_mode on)"),
    ("on", {"RAY_ADDRESS": 0}, "CPU mode (--drpo.cpu_mode on): a local Ray on this machine replaces the Ray cluster "
                               "at {0} (RAY_ADDRESS)"),
    ("off", {"RAY_ADDRESS": 0}, "GPU mode (--drpo.cpu_mode off)"),
])
def test_cpu_mode_auto_asks_the_ray_cluster_and_says_which_mode_and_why(ray_clusters, no_ray_cluster, monkeypatch,
                                                                        tmp_path, choice, env, line):
    from openrlhf_drpo.hosts.openrlhf.launch import decide_cpu_mode
    if torch.cuda.is_available() and env == {} and choice == "auto":       # this machine's GPUs, with no cluster
        n = torch.cuda.device_count()
        line = f"GPU mode: {n} CUDA device{'s' * (n != 1)} on this machine and no Ray cluster (--drpo.cpu_mode auto)"
    record = _record_ray_start(tmp_path, ray_clusters[env["record"]]) if "record" in env else None
    if "RAY_ADDRESS" in env:
        monkeypatch.setenv("RAY_ADDRESS", ray_clusters[env["RAY_ADDRESS"]])
    cpu, said = decide_cpu_mode(choice)
    assert said == "openrlhf-drpo: " + line.format(*[ray_clusters.get(g) for g in range(3)], record=record)
    assert cpu == said.startswith("openrlhf-drpo: CPU mode")


@pytest.mark.parametrize("env, message", [
    ({"RAY_ADDRESS": 0}, "the Ray cluster at {0} (RAY_ADDRESS) has no GPU, and --drpo.cpu_mode auto does not train on "
                         "this machine's CPU while a cluster is set up: use a cluster with GPUs, or --drpo.cpu_mode on "
                         "to train on this machine's CPU with a local Ray"),
    ({"record": 0}, "the Ray cluster at {0} (recorded by `ray start` in {record}) has no GPU"),
    ({"RAY_ADDRESS": "127.0.0.1:{port}"}, "no Ray cluster answers at 127.0.0.1:{port} (RAY_ADDRESS): start it, point "
                                          "RAY_ADDRESS at one that runs, or use --drpo.cpu_mode on"),
    ({"record": "127.0.0.1:{port}"}, "no Ray cluster answers at 127.0.0.1:{port} (recorded by `ray start` in {record})"),
])
def test_cpu_mode_auto_never_falls_back_to_the_cpu_where_a_ray_cluster_is_set_up(ray_clusters, no_ray_cluster,
                                                                               monkeypatch, tmp_path, capsys, env,
                                                                               message):
    from openrlhf_drpo.hosts.openrlhf import train
    (where, value), = env.items()
    address = ray_clusters[value] if isinstance(value, int) else value.format(port=_free_port())
    record = _record_ray_start(tmp_path, address) if where == "record" else None
    if where == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(SystemExit) as exit_:      # a command line without errors: those would come first
        train.main(train_flags(tmp_path, "unused", "drpo"))
    expected = message.format(address, port=address.rpartition(":")[2], record=record)
    assert str(exit_.value.code).startswith(f"drpo-train: error: {expected}"), exit_.value.code
    assert capsys.readouterr().out == ""        # nothing ran, and no mode was announced


def test_drpo_train_says_the_mode_and_why_on_its_first_line(ray_clusters, no_ray_cluster, monkeypatch, tmp_path, capsys):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    monkeypatch.setenv("RAY_ADDRESS", ray_clusters[2])
    openrlhf_args(train_flags(tmp_path, "unused", "spo"))
    assert capsys.readouterr().out.splitlines()[0] == \
        f"openrlhf-drpo: GPU mode: the Ray cluster at {ray_clusters[2]} (RAY_ADDRESS) has 2 GPUs (--drpo.cpu_mode auto)"


def _drpo_train(*args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def drpo_train_help():
    """`drpo-train --help`, run once for the tests that read it (a process costs OpenRLHF's import)."""
    return _drpo_train("--help")


def test_drpo_train_help_shows_openrlhfs_flags_and_the_drpo_flags(drpo_train_help):
    assert drpo_train_help.returncode == 0, drpo_train_help.stderr
    for flag in ("--actor.model_name_or_path", "--rollout.n_samples_per_prompt", "--vllm.num_engines",
                 "--drpo.objective", "--drpo.set", "--drpo.anchor"):
        assert flag in drpo_train_help.stdout


def test_a_bad_objective_stops_drpo_train_before_ray_starts(tmp_path):
    bad = tmp_path / "bad.dsl"
    bad.write_text("δ = 0.2\nr*A - |A|/(2δ)*μ*(r - 1)^2 + foo\n")
    proc = _drpo_train("--drpo.objective", str(bad), "--actor.model_name_or_path", "x")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{bad}:2:30: error: unknown name 'foo'")
    after_the_mode_line = proc.stdout.partition("\n")[2]
    assert "Traceback" not in proc.stderr and "ray" not in after_the_mode_line.lower()


def test_drpo_train_composes_openrlhfs_is_correction_with_the_objective(tiny_model, tmp_path, capsys):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    args = openrlhf_args(train_flags(tmp_path, tiny_model, "drpo", "--algo.advantage.is_correction_level", "seq",
                                     "--algo.advantage.is_correction_threshold", "0.8", "1.25"))
    spec = json.loads(args.drpo.spec)
    assert "[exp(seq_mean(log(π_old) - log(π_rollout))) >= 0.8 and" in spec["source"]
    out = capsys.readouterr().out
    assert "is composed with the objective" in out and "mismatch   ρ = π_old/π_rollout" in out
    assert "δ = 12.5" in spec["source"] and spec["options"]["anchor"] == "old"


@pytest.mark.parametrize("flags, message", [
    (["--algo.advantage.is_correction_mode", "clip", "--algo.advantage.is_correction_level", "seq"],
     "is_correction_mode=clip requires is_correction_level=token"),
    (["--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_level", "token"],
     "is_correction_gating=tv takes an upper bound only"),
    (["--algo.advantage.is_correction_level", "token", "--drpo.anchor", "rollout"],
     "would correct for the rollout policy twice"),
    (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_threshold", "1", "2", "3"],
     "--algo.advantage.is_correction_threshold takes HIGH or LOW HIGH"),
])
def test_an_is_correction_policy_loss_would_refuse_is_refused(flags, message, tmp_path):
    # a command line without argument errors: those are reported first, before OpenRLHF parses it.
    # In this process (drpo-train's own parse, as openrlhf_args runs it): a drpo-train process
    # costs OpenRLHF's import, half a minute on 2 cores; the next test runs one end to end
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    with pytest.raises(SystemExit) as refused:
        openrlhf_args(train_flags(tmp_path, "x", "drpo", *flags))
    assert message in str(refused.value.code)


def test_drpo_train_refuses_an_is_correction_it_cannot_compose_by_name_without_a_traceback(tmp_path):
    proc = _drpo_train(*train_flags(tmp_path, "x", "drpo", "--algo.advantage.is_correction_level", "token",
                                    "--drpo.anchor", "rollout"))
    assert proc.returncode == 1 and "would correct for the rollout policy twice" in proc.stderr
    assert proc.stderr.startswith("drpo-train: error: ") and "Traceback" not in proc.stderr


def test_an_objective_naming_the_rollout_policy_makes_openrlhf_keep_vllms_log_probs(tiny_model, tmp_path):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    args = openrlhf_args(train_flags(tmp_path, tiny_model, "tis_ppo", "--algo.advantage.is_correction_gating", "tv"))
    assert args.algo.advantage.is_correction_level == "token"
    # a gating flag that did nothing while the correction was off must not make PolicyLoss refuse
    assert args.algo.advantage.is_correction_gating == "ratio"


def test_rollout_anchor_makes_openrlhf_keep_vllms_log_probs(tiny_model, tmp_path):
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    args = openrlhf_args(train_flags(tmp_path, tiny_model, "drpo", "--drpo.anchor", "rollout"))
    assert args.algo.advantage.is_correction_level == "token"     # what makes vLLM return log-probs
    assert '"anchor": "rollout"' in args.drpo.spec
    assert openrlhf_args(train_flags(tmp_path, tiny_model, "drpo")).algo.advantage.is_correction_level == "off"


@pytest.mark.parametrize("script", sorted(p for p in os.listdir(os.path.join(os.path.dirname(__file__), "..", "examples"))
                                          if p.endswith(".sh")))
def test_example_scripts_are_valid_bash(script):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", script)
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0


def test_every_flag_the_recipes_pass_exists_in_openrlhfs_parser(drpo_train_help):
    import re
    help_text = drpo_train_help.stdout
    common = open(os.path.join(os.path.dirname(__file__), "..", "examples", "common.sh")).read()
    flags = set(re.findall(r"(--[a-z_]+(?:\.[a-z_]+)+)", common))
    assert len(flags) > 20
    assert not [f for f in flags if f"{f} " not in help_text and f"{f}\n" not in help_text]


def test_a_recipe_without_its_data_says_how_to_prepare_it(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "r1d_1p5b_sanity.sh")
    proc = subprocess.run(["bash", script, "drpo"], capture_output=True, text=True,
                          env={**os.environ, "DATA": str(tmp_path / "r1d_sanity.jsonl")})
    assert proc.returncode == 1 and proc.stdout == ""
    assert "no prompt data at" in proc.stderr and "SANITY_SOURCE=" in proc.stderr


def test_the_first_run_says_deepspeed_is_compiling_and_later_runs_do_not(tmp_path):
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import first_compile_note
    assert "compiling DeepSpeed's CPU ops" in first_compile_note(str(tmp_path))
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert first_compile_note(str(tmp_path)) is None
