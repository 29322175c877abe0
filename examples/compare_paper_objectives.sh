#!/usr/bin/env bash
# The paper's main comparison: one run per objective for both settings.
#   bash examples/compare_paper_objectives.sh [qwen3_4b_dapo|r1d_1p5b_sanity]
set -euo pipefail
SETTING="${1:-qwen3_4b_dapo}"
HERE="$(cd "$(dirname "$0")" && pwd)"
drpo-analyze surrogate grpo_clip_higher spo dppo_binary_tv drpo   # what each one does to the gradient, first
for objective in surrogate grpo_clip_higher spo dppo_binary_tv drpo; do
  RUN_NAME="${SETTING}-${objective}" bash "$HERE/${SETTING}.sh" "$objective"
done
