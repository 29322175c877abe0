"""Checks that each build a DeepSpeed engine (drpo-train's policy actor, in CPU mode), run in one child
process rather than one each: a process's start-up (importing OpenRLHF and DeepSpeed, their first
engine) is most of such a check's time, and a second engine in the same process starts in about a
second (measured: test_accumulation_train 39 -> 22 s for its two checks, test_train_v3 68 -> 37 s
for its three, one process against one each)."""
import json
import os
import subprocess
import sys

from test_train import cpu_environment


def checks_in_one_process(module: str, calls: dict) -> dict:
    """Each named call `module.function(*args)` (calls: {name: (function, args)}) in turn, in one
    child process with cpu_environment(), each on a DeepSpeed engine of its own: the process's
    start-up (OpenRLHF, DeepSpeed: most of a check's time) once. Returns each call's outcome by
    name: "ok", or its failure's traceback (the next call still runs)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import one_process; "
            f"one_process._run_checks({module!r}, {json.dumps(calls)!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **cpu_environment()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("outcomes: ")][-1]
    return json.loads(line[len("outcomes: "):])


def _run_checks(module: str, calls: str) -> None:
    import importlib
    import traceback
    from openrlhf_drpo.hosts.openrlhf.cpu_mode import install_flash_attn_shim
    install_flash_attn_shim()
    checks, outcomes = importlib.import_module(module), {}
    for name, (function, args) in json.loads(calls).items():
        try:
            getattr(checks, function)(*args)
            outcomes[name] = "ok"
        except Exception:
            outcomes[name] = traceback.format_exc()[-4000:]
    print("outcomes: " + json.dumps(outcomes))
