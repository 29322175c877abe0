#!/usr/bin/env bash
# Installs everything openrlhf-drpo needs into the current Python, on a machine without CUDA.
# openrlhf's wheel pins flash-attn (needs CUDA to build) and vllm (a CUDA stack), so it is
# installed with --no-deps and its real runtime needs are listed here instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q --no-deps openrlhf==0.11.2
$PY -m pip install -q torch==2.13.0 deepspeed==0.19.6 transformers==5.15.0 ray==2.55.0 \
    peft accelerate einops datasets torchdata pylatexenc aiohttp pillow \
    tensorboard jsonlines optree
$PY -m pip install -q -e '.[test]'
