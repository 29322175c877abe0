#!/usr/bin/env bash
# Qwen3-4B-Base on the DAPO math set: train batch 64 prompts x group 8, mini-batch 32.
#   bash examples/qwen3_4b_dapo.sh drpo                 # or surrogate, grpo_clip_higher, spo, dppo_binary_tv
#   bash examples/qwen3_4b_dapo.sh drpo --drpo.set delta=2.5
set -euo pipefail
OBJECTIVE="${1:?usage: $0 OBJECTIVE [--drpo.set NAME=VALUE]...}"; shift
DRPO_FLAGS=("$@")
MODEL="${MODEL:-Qwen/Qwen3-4B-Base}"
DATA="${DATA:-$(dirname "$0")/../data/dapo_math.jsonl}"
GROUP=8 TRAIN_BATCH=64 MINI_BATCH=32
source "$(dirname "$0")/common.sh"
