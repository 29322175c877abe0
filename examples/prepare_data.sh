#!/usr/bin/env bash
# Data preparation, run once on a machine with network access (training never downloads):
# writes JSONL files with "prompt" and "answer" keys, as the launch scripts read them.
#   bash examples/prepare_data.sh [OUT_DIR]
# DAPO_SOURCE / SANITY_SOURCE name the Hugging Face datasets (override to use local copies).
set -euo pipefail
OUT="${1:-$(dirname "$0")/../data}"
mkdir -p "$OUT"
DAPO_SOURCE="${DAPO_SOURCE:-BytedTsinghua-SIA/DAPO-Math-17k}"
SANITY_SOURCE="${SANITY_SOURCE:-}"
python3 - "$OUT" "$DAPO_SOURCE" "$SANITY_SOURCE" <<'PY'
import json, os, sys
from datasets import load_dataset

out, dapo, sanity = sys.argv[1:4]
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

def write(rows, path):
    with open(path, "w", encoding="utf-8") as f:
        for prompt, answer in rows:
            f.write(json.dumps({"prompt": prompt + SUFFIX, "answer": str(answer)}, ensure_ascii=False) + "\n")
    print(f"wrote {path}")

ds = load_dataset(dapo, split="train")
# DAPO-Math-17k stores a chat prompt and the reference in reward_model.ground_truth
write(((r["prompt"][-1]["content"], r["reward_model"]["ground_truth"]) for r in ds), os.path.join(out, "dapo_math.jsonl"))
if sanity:
    ds = load_dataset(sanity, split="train")
    write(((r["problem"], r["answer"]) for r in ds), os.path.join(out, "r1d_sanity.jsonl"))
else:
    print("SANITY_SOURCE not set: give the R1D sanity set's dataset name to write r1d_sanity.jsonl")
PY
