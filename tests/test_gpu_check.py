"""benchmarks/gpu_check.py, the one-shot GPU check, run as it runs on a GPU but on the CPU at toy
sizes (--quick), with dynamo's eager backend (inductor's code generation takes minutes on a CPU):
every part is there in its JSON, exact where it checks exactness."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dsl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--backend", "eager", "--budget", "600"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_gpu_check_reports_every_part_and_every_objective_is_exact(report):
    assert report["device"] == "cpu" and report["quick"] and report["backend"] == "eager"
    # one compiled objective in --quick: a forward and a backward graph per dtype, three lengths
    assert report["compile"] == {"ppo": {"graphs": 4, "frames": 4, "seconds": report["compile"]["ppo"]["seconds"]}}
    exactness = report["exactness"]
    assert set(exactness) == {"plain fp32", "fused fp32", "fused bf16", "compiled fp32", "compiled bf16"}
    for path, row in exactness.items():
        assert row["within"] and row["non_finite"] == 0, (path, row)
        # every shipped objective, a vocabulary sum's gradient with its support's
        assert row["objectives"] == (1 if path.startswith("compiled") else len(dsl.shipped_names()))
    assert report["syncs"] == {"skipped": "CUDA only (tests/test_core.py records host reads on the CPU)"}
    runs = report["speed"]["runs"]
    assert set(runs) == {f"{n} {d} {s}" for n in ("ppo", "drpo") for d in ("fp32", "bf16") for s in ("32k", "64k")}
    for row in runs.values():
        assert set(row) == {"hand eager", "hand compiled", "ours compiled", "ours / hand compiled",
                            "ours fraction of copy bandwidth"}
        assert row["ours / hand compiled"]["time"] > 0
    step = report["step_0p5b"]
    assert step["log_probs"] == "__main__.chunked_log_probs" and step["shape"]["vocab"] == 2048
    assert step["difference"]["loss"] < 1e-6 and step["difference"]["grad_hidden"] < 1e-5
    assert step["difference"]["grad_weight"] < 1e-5
    assert report["trl"]["equal"] and len(report["trl"]["steps"]) == 3


def test_a_chunked_log_prob_function_named_on_the_command_line_is_checked_or_skipped_with_the_reason():
    import gpu_check
    got = gpu_check.step_0p5b("cpu", True, "gpu_check:chunked_log_probs", {})
    assert got["log_probs"] == "gpu_check.chunked_log_probs" and got["difference"]["grad_weight"] < 1e-5
    assert gpu_check.step_0p5b("cpu", True, "openrlhf_drpo.hosts.openrlhf.nowhere:log_probs", {}) == {
        "skipped": "--chunked openrlhf_drpo.hosts.openrlhf.nowhere:log_probs: ModuleNotFoundError: No module named "
                   "'openrlhf_drpo.hosts.openrlhf.nowhere'"}


def test_loss_speed_imports_no_openrlhf_unless_policyloss_is_asked_for():
    """benchmarks/loss_speed.py builds CompiledLoss (the host-neutral core): it runs on a machine
    without OpenRLHF, which only its policyloss variant imports (where installed)."""
    code = ("import runpy, sys\n"
            "sys.argv = ['loss_speed.py', '--sizes', '4k', '--T', '1024', '--dtypes', 'fp32', '--objectives', 'ppo',"
            " '--repeat', '1', '--variants', 'hand,fused_eager', '--hosts', 'none']\n"
            "runpy.run_path('benchmarks/loss_speed.py', run_name='__main__')\n"
            "assert not any(m.split('.')[0] in ('openrlhf', 'deepspeed') for m in sys.modules), 'imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result["runs"]["fp32"]["4k"]["objectives"]["ppo"]["time_ms"]) == {"hand", "fused_eager"}


def test_the_support_memory_benchmark_scores_the_chunked_support_as_the_full_logits_do():
    """benchmarks/support_memory.py (the vocabulary sum at a real head's shape on CUDA, docs/benchmarks.md)
    at toy sizes on the CPU: its two ways of scoring the support give one loss and one gradient."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "support_memory.py"), "--device", "cpu", "--quick"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["shape"] == {"B": 2, "T": 64, "hidden": 64, "vocab": 2048, "k": 8, "dtype": "torch.float32"}
    assert out["difference"]["loss"] <= 1e-6 and max(out["difference"]["grad_hidden"],
                                                     out["difference"]["grad_weight"]) <= 1e-6, out["difference"]
    assert out["full"]["ms"] > 0 and out["chunked"]["ms"] > 0
