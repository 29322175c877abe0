"""Test setup. OpenRLHF 0.11.2 imports names from vllm and flash_attn at module level; on
machines without them (CPU CI) minimal import stand-ins from tests/standins are appended to
the path, also for subprocesses and Ray workers (PYTHONPATH). Real packages win when present."""
import importlib.util
import os
import pathlib
import sys

STANDINS = pathlib.Path(__file__).parent / "standins"
if any(importlib.util.find_spec(m) is None for m in ("vllm", "flash_attn")):
    sys.path.append(str(STANDINS))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(STANDINS)) if p)
