"""Checks that each build a DeepSpeed engine (drpo-train's policy actor, in CPU mode), run in one child
process rather than one each: a process's start-up (importing OpenRLHF and DeepSpeed, their first
engine) is most of such a check's time, and a second engine in the same process starts in about a
second, with its own configuration (ZeRO-3's parameters partitioned between a ZeRO-2 engine and
another ZeRO-2 one). Measured, one process against one each: test_accumulation_train 39 -> 22 s for
its two checks, test_train_v3 68 -> 37 s for its three."""
import json
import os
import subprocess
import sys
import tempfile

from test_train import cpu_environment


def checks_in_one_process(module: str, calls: dict) -> dict:
    """Each named call `module.function(*args)` (calls: {name: (function, args)}) in turn, in one
    child process with cpu_environment(), each on a DeepSpeed engine of its own: the process's
    start-up once. Returns {name: {"error": None or the failure's traceback (the next call still
    runs), "value": what it returned (JSON), "output": what it wrote to stdout}}."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import one_process; "
            f"one_process._run_checks({module!r}, {json.dumps(calls)!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **cpu_environment()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("results: ")][-1]
    return json.loads(line[len("results: "):])


def _run_checks(module: str, calls: str) -> None:
    import importlib
    import traceback
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import install_flash_attn_shim
    install_flash_attn_shim()
    checks, results = importlib.import_module(module), {}
    for name, (function, args) in json.loads(calls).items():
        result = results[name] = {"error": None, "value": None}
        # the call's own stdout, at the descriptor (prints, logging and child processes alike)
        sys.stdout.flush()
        saved = os.dup(1)
        with tempfile.TemporaryFile("w+") as captured:
            os.dup2(captured.fileno(), 1)
            try:
                result["value"] = getattr(checks, function)(*args)
            except Exception:
                result["error"] = traceback.format_exc()[-4000:]
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
                captured.seek(0)
                result["output"] = captured.read()
    print("results: " + json.dumps(results))
