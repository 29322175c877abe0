#!/usr/bin/env bash
# DeepSeek-R1-Distill-Qwen-1.5B on its sanity set: train batch 64 x group 8, mini-batch 16.
#   bash examples/r1d_1p5b_sanity.sh drpo
set -euo pipefail
OBJECTIVE="${1:?usage: $0 OBJECTIVE [--drpo.set NAME=VALUE]...}"; shift
DRPO_FLAGS=("$@")
MODEL="${MODEL:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}"
DATA="${DATA:-$(dirname "$0")/../data/r1d_sanity.jsonl}"
GROUP=8 TRAIN_BATCH=64 MINI_BATCH=16
# the paper's R1D sanity set (1,460 solvable questions, its reference [fp16]) has no default name here
PREPARE="SANITY_SOURCE=<that dataset's name or local path> bash examples/prepare_data.sh"
source "$(dirname "$0")/common.sh"
