"""drpo-train's launch-time checks on OpenRLHF's own flags (issue 36, item 5): PolicyLoss's options,
which the objective replaces, are refused when set, naming the objective's equivalent and the
command that writes PolicyLoss with them as an objective; the flags whose absence crashes deep in
a Ray actor are named by pre-flight before Ray starts."""
import argparse
import os
import subprocess
import sys

import pytest

from openrlhf_drpo.hosts.openrlhf import launch
from openrlhf_drpo.hosts.openrlhf.options import SUPERSEDED, policy_loss_text, refuse_superseded, superseded_flags

REWARD = os.path.join(os.path.dirname(__file__), "..", "openrlhf_drpo", "hosts", "openrlhf", "reward.py")
# the issue's migrated script: GSPO at ε = 0.1, dual clip 3, per-sequence aggregation
ISSUE_FLAGS = ["--actor.eps_clip", "0.1", "--actor.policy_loss_type", "gspo", "--actor.dual_clip", "3",
               "--actor.loss_agg_mode", "seq-mean-token-mean"]


@pytest.mark.parametrize("argv, flag, equivalent", [
    (["--actor.eps_clip", "0.1"], "--actor.eps_clip 0.1", "--drpo.set eps_low=0.1 --drpo.set eps_high=0.1"),
    (["--actor.eps_clip=0.1"], "--actor.eps_clip 0.1", "--drpo.set eps_low=0.1 --drpo.set eps_high=0.1"),
    (["--actor.eps_clip_low_high", "0.2", "0.28"], "--actor.eps_clip_low_high 0.2 0.28",
     "--drpo.set eps_low=0.2 --drpo.set eps_high=0.28"),
    (["--actor.dual", "3"], "--actor.dual_clip 3.0", "the objective ppo_dual_clip, with --drpo.set c=3.0"),
    (["--actor.policy_loss_type", "gspo"], "--actor.policy_loss_type gspo", "the objective gspo"),
    (["--actor.loss_agg_mode", "seq-mean-token-mean"], "--actor.loss_agg_mode seq-mean-token-mean",
     "@aggregate = seq-mean-token-mean"),
    # at OpenRLHF's default too: the user believes it acts
    (["--actor.loss_agg_mode", "token-mean"], "--actor.loss_agg_mode token-mean", "@aggregate = token-mean"),
])
def test_each_policyloss_flag_set_is_refused_naming_the_objectives_equivalent(argv, flag, equivalent):
    with pytest.raises(SystemExit) as e:
        refuse_superseded(["--drpo.objective", "drpo", "--actor.num_gpus_per_node", "1", *argv])
    message = str(e.value.code)
    assert message.startswith(f"drpo-train: error: {flag}: OpenRLHF's PolicyLoss reads this"), message
    assert equivalent in message
    assert f"python3 -m openrlhf_drpo.hosts.openrlhf.options {flag} > policy_loss.dsl" in message


def test_a_command_line_without_policylosss_flags_passes():
    argv = ["--actor.model_name_or_path", "m", "--actor.entropy_coef", "0.01", "--actor.num_gpus_per_node", "1",
            "--algo.advantage.is_correction_level", "token", "--vllm.num_engines", "1"]
    assert superseded_flags(argv) == {}
    refuse_superseded(argv)


@pytest.fixture(scope="module")
def help_text():
    proc = _drpo_train("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("subset", ["refused", "early"])
def test_the_flags_read_before_openrlhf_are_openrlhfs_and_no_other_flag_abbreviates_to_one(help_text, subset):
    """superseded_flags and early_errors resolve abbreviations with a parser of their flags alone:
    that agrees with OpenRLHF's parser only while none of its other flags is a prefix of one of them."""
    import re
    flags = set(re.findall(r"(--[a-z_]+(?:\.[a-z_]+)+)", help_text))
    read = {"--" + flag for flag in (SUPERSEDED if subset == "refused" else launch.EARLY_FLAGS)}
    assert read <= flags, read - flags
    assert not [(f, r) for f in flags - read for r in read if r.startswith(f)]


def test_help_puts_the_drpo_flags_first(help_text):
    usage, first, *_ = help_text.split("\n\n")
    assert usage == "usage: drpo-train --drpo.objective FILE_OR_NAME [--drpo.* ...] [OpenRLHF's train_ppo_ray options ...]"
    assert first.startswith("openrlhf-drpo: train with a compiled objective:\n  --drpo.objective FILE_OR_NAME")
    assert help_text.index("--drpo.cpu_mode") < help_text.index("OpenRLHF's train_ppo_ray options (") < \
        help_text.index("--ref.num_nodes")


# each refused flag's help: the objective's equivalent, at placeholder values
REFUSED_HELP = {
    "actor.eps_clip": "--drpo.set eps_low=EPS_CLIP --drpo.set eps_high=EPS_CLIP",
    "actor.eps_clip_low_high": "--drpo.set eps_low=LOW --drpo.set eps_high=HIGH",
    "actor.dual_clip": "the objective ppo_dual_clip, with --drpo.set c=DUAL_CLIP",
    "actor.policy_loss_type": "the objective POLICY_LOSS_TYPE (--drpo.objective POLICY_LOSS_TYPE)",
    "actor.loss_agg_mode": "@aggregate = LOSS_AGG_MODE",
}


@pytest.mark.parametrize("flag", SUPERSEDED)
def test_help_marks_each_refused_flag_naming_the_objectives_equivalent(help_text, flag):
    entry = " ".join(help_text.split(f"\n  --{flag} ", 1)[1].split("\n  --", 1)[0].split())
    assert "REFUSED by drpo-train" in entry and REFUSED_HELP[flag] in entry, entry


def test_the_command_the_refusal_names_writes_policyloss_under_those_flags():
    """The command in the message, run: PolicyLoss's arguments as OpenRLHF 0.11.2's ppo_actor builds
    them from the flags (written out here), as policy_loss_text writes them."""
    with pytest.raises(SystemExit) as e:
        refuse_superseded(ISSUE_FLAGS)
    command = next(line for line in str(e.value.code).splitlines() if "python3 -m" in line)
    args = command.split("python3 -m openrlhf_drpo.hosts.openrlhf.options ")[1].split(" > ")[0].split()
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.options", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == policy_loss_text(clip_eps_low=0.1, clip_eps_high=0.1, dual_clip=3.0, token_level_loss=False,
                                           policy_loss_type="gspo")


def _drpo_train(*args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def _command_line(tmp_path, *drop):
    """A CPU-mode command line whose paths exist (pre-flight checks them), less the flags in `drop`."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "prompts.jsonl").write_text('{"input": "a b c"}\n')
    flags = {"--actor.model_name_or_path": [str(tmp_path / "model")], "--reward.remote_url": [REWARD],
             "--data.prompt_dataset": [str(tmp_path / "prompts.jsonl")], "--vllm.num_engines": ["1"],
             "--actor.num_gpus_per_node": ["1"], "--algo.kl.init_coef": ["0"], "--ckpt.output_dir": [str(tmp_path)]}
    return ["--drpo.objective", "drpo", "--drpo.cpu_mode", "on",
            *[a for flag, values in flags.items() if flag not in drop for a in (flag, *values)]]


def test_drpo_train_refuses_the_issues_migrated_gspo_flags_before_ray_starts(tmp_path):
    proc = _drpo_train(*_command_line(tmp_path), *ISSUE_FLAGS)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("drpo-train: error: --actor.eps_clip 0.1, --actor.dual_clip 3.0, "
                                  "--actor.policy_loss_type gspo, --actor.loss_agg_mode seq-mean-token-mean: "
                                  "OpenRLHF's PolicyLoss reads these"), proc.stderr[-2000:]
    assert "starting a local Ray" not in proc.stdout


def _flat(**flags):
    """OpenRLHF's flat namespace at parse time, as much of it as pre-flight reads (a CPU-mode run)."""
    defaults = {"actor.model_name_or_path": "org/model", "reward.model_name_or_path": None,
                "critic.model_name_or_path": None, "data.prompt_dataset": "org/prompts", "reward.remote_url": REWARD,
                "train.agent_func_path": None, "vllm.num_engines": 1}
    return argparse.Namespace(**{**defaults, **{k.replace("__", "."): v for k, v in flags.items()}})


@pytest.mark.parametrize("flags, message", [
    ({"vllm__num_engines": None}, "missing --vllm.num_engines (the number of vLLM engines, 1 or more"),
    ({"vllm__num_engines": 0}, "missing --vllm.num_engines (the number of vLLM engines, 1 or more"),
    ({"actor__model_name_or_path": None}, "missing --actor.model_name_or_path (the policy to train"),
    ({"data__prompt_dataset": None}, "missing --data.prompt_dataset (the prompts"),
    ({"data__prompt_dataset": None, "vllm__num_engines": None},
     "missing --data.prompt_dataset (the prompts: a Hugging Face dataset name or a local .jsonl, .json or .parquet "
     "file); --vllm.num_engines (the number of vLLM engines"),
])
def test_preflight_names_each_flag_whose_absence_crashes_deep(flags, message):
    with pytest.raises(SystemExit) as e:
        launch.preflight(_flat(**flags), cpu=True)
    assert str(e.value.code).startswith(f"drpo-train: error: {message}"), e.value.code
    launch.preflight(_flat(), cpu=True)     # and with them all, it passes


def test_drpo_train_without_vllm_engines_stops_before_ray_naming_the_flag(tmp_path):
    proc = _drpo_train(*_command_line(tmp_path, "--vllm.num_engines"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("drpo-train: error: missing --vllm.num_engines"), proc.stderr[-2000:]
    assert "starting a local Ray" not in proc.stdout


@pytest.mark.parametrize("value, kept, why", [
    ("4", "4", None), (None, "1", "it was unset"), ("500000", "1", "500000 GiB is more than half of this machine's memory"),
    ("lots", "1", "'lots' is not a number of GiB > 0"), ("-2", "1", "'-2' is not a number of GiB > 0"),
])
def test_cpu_mode_keeps_a_users_kv_cache_size_or_says_what_it_set_and_why(value, kept, why):
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    size, note = cpu_mode.kv_cache_gib(value)
    assert size == kept and (note is None) == (why is None)
    if why:
        assert note.startswith(f"openrlhf-drpo: CPU mode sets VLLM_CPU_KVCACHE_SPACE=1 (GiB, vLLM's CPU KV cache): "
                               f"{why}"), note


def test_drpo_train_says_at_run_time_that_it_replaced_the_users_kv_cache_size(tmp_path, monkeypatch):
    """CPU mode replaced a VLLM_CPU_KVCACHE_SPACE it could not use without a word: a run now says so,
    with the mode line once every check has passed (here a run stopped where OpenRLHF starts Ray)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "500000")
    code = ("import ray, sys\ndef stop(*a, **k):\n    raise SystemExit('stopped where Ray starts')\n"
            "ray.is_initialized = stop\nfrom openrlhf_drpo.hosts.openrlhf.train import console_main\nconsole_main()\n")
    proc = subprocess.run([sys.executable, "-c", code, *_command_line(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert "stopped where Ray starts" in proc.stderr, proc.stderr[-2000:]
    assert ("openrlhf-drpo: CPU mode sets VLLM_CPU_KVCACHE_SPACE=1 (GiB, vLLM's CPU KV cache): 500000 GiB is more "
            "than half of this machine's memory") in proc.stdout, proc.stdout


# drpo-train run to its exit, then the heavy modules it imported, on stdout after whatever it printed
_WRAPPED = ("import sys\nfrom openrlhf_drpo.hosts.openrlhf.train import console_main\n"
            "try:\n    console_main()\nfinally:\n"
            "    print('imported:', sorted(m for m in ('openrlhf', 'ray', 'vllm', 'torch', 'deepspeed') "
            "if sys.modules.get(m) is not None))\n")


@pytest.mark.parametrize("argv, errors", [
    # the issue's: a refused flag without an objective reports both (and the missing flags)
    (["--actor.eps_clip", "0.2", "--drpo.cpu_mode", "on"],
     ["drpo-train: error: --drpo.objective FILE_OR_NAME is required",
      "drpo-train: error: --actor.eps_clip 0.2: OpenRLHF's PolicyLoss reads this",
      "drpo-train: error: missing --actor.model_name_or_path", "drpo-train: error: no reward"]),
    # a bad file in CPU mode: the located error, no "CPU mode" line before it
    (["{complete}", "--drpo.objective", "{bad}"], ["{bad}:1:6: error: unexpected end of line"]),
    (["{complete}", "--drpo.set", "delta=x", "--actor.dual", "3"],
     ["--drpo.set:1:7: error: parameter value 'x' is not a finite number",
      "drpo-train: error: --actor.dual_clip 3.0: OpenRLHF's PolicyLoss reads this"]),
    (["{complete}", "--drpo.set", "foo=1", "--actor.model_name_or_path", "./no/model"],
     ["--drpo.set:1:1: error: unknown parameter 'foo' for objective 'drpo'",
      "drpo-train: error: --actor.model_name_or_path ./no/model: no such file or directory"]),
    (["--drpo.objective"], ["drpo-train: error: argument --drpo.objective: expected one argument"]),
])
def test_drpo_train_reports_every_argument_error_at_once_before_importing_openrlhf(tmp_path, argv, errors):
    bad = tmp_path / "bad.dsl"
    bad.write_text("r*A +\n")
    complete = _command_line(tmp_path)
    args = [w for a in argv for w in (complete if a == "{complete}" else [a.format(bad=bad)])]
    proc = subprocess.run([sys.executable, "-c", _WRAPPED, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout == "imported: []\n"      # nothing said before the errors, nothing heavy imported
    said = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(said) == len(errors) and all(s.startswith(e.format(bad=bad)) for s, e in zip(said, errors)), said


@pytest.mark.parametrize("argv", [["--help"], ["{complete}"]])
def test_drpo_train_without_torch_is_one_line_naming_the_install(tmp_path, argv):
    """An analyser-only install (`pip install .`), simulated: torch cannot be imported."""
    args = [w for a in argv for w in (_command_line(tmp_path) if a == "{complete}" else [a])]
    code = "import sys\nsys.modules['torch'] = None\n" + _WRAPPED
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == "imported: []\n", proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("drpo-train: error: training needs torch, "), \
        proc.stderr
    assert "bash scripts/setup.sh" in proc.stderr and "pip install '.[train]'" in proc.stderr


@pytest.mark.parametrize("argv, expected", [
    (["--drpo.set", "delta"], "--drpo.set:1:1: error: expected name=value"),         # was located at --set
    (["--drpo.set", "delta=0.2", "--drpo.set", "delta=0.3"], "--drpo.set:1:1: error: 'delta' is set twice"),
    (["--drpo.anchor", "bogus"], "argument --drpo.anchor: invalid choice: 'bogus'"),  # was found after OpenRLHF's import
])
def test_early_errors_name_drpo_trains_own_flag_and_refuse_a_bad_anchor_before_openrlhf(argv, expected):
    errors = launch.early_errors(["--drpo.objective", "drpo", "--actor.model_name_or_path", "m",
                                  "--data.prompt_dataset", "d", "--vllm.num_engines", "1",
                                  "--reward.remote_url", "http://x"] + argv)
    assert any(e.startswith(expected) or expected in e for e in errors), errors
