#!/usr/bin/env bash
# Shared settings for the paper's recipes (Appendix D, Table "Hyperparameters"): lr 1e-6,
# 1 PPO epoch, prompt 2048 / response 8192 tokens, temperature 1.0, GRPO-style
# group-normalised advantages. Sourced by the launch scripts; MODEL, DATA, GROUP, TRAIN_BATCH
# and MINI_BATCH are set by the caller. OBJECTIVE and any --drpo.set flags come as arguments.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_NAME="${RUN_NAME:-$(basename "$MODEL")-${OBJECTIVE}}"
OUT="${OUT:-$HERE/../runs/$RUN_NAME}"
if [ ! -f "$DATA" ]; then
    echo "$(basename "$0"): no prompt data at $DATA: prepare it first with ${PREPARE:-bash examples/prepare_data.sh}" >&2
    exit 1
fi
NUM_GPUS="${NUM_GPUS:-8}"

drpo-train \
  --drpo.objective "$OBJECTIVE" "${DRPO_FLAGS[@]}" \
  --actor.model_name_or_path "$MODEL" \
  --actor.num_nodes 1 --actor.num_gpus_per_node "$NUM_GPUS" \
  --vllm.num_engines "$NUM_GPUS" --vllm.tensor_parallel_size 1 --train.colocate_all \
  --vllm.gpu_memory_utilization 0.6 --vllm.enable_sleep --ds.enable_sleep \
  --data.prompt_dataset "$DATA" --data.input_key prompt --data.label_key answer --data.apply_chat_template \
  --reward.remote_url "$HERE/../openrlhf_drpo/hosts/openrlhf/reward.py" \
  --algo.advantage.estimator group_norm \
  --rollout.n_samples_per_prompt "$GROUP" --rollout.temperature 1.0 \
  --rollout.batch_size "$TRAIN_BATCH" --train.batch_size "$((TRAIN_BATCH * GROUP / (TRAIN_BATCH / MINI_BATCH)))" \
  --train.max_epochs 1 --train.micro_batch_size 2 --rollout.micro_batch_size 4 \
  --data.max_len 10240 --rollout.max_new_tokens 8192 \
  --actor.adam.lr 1e-6 --actor.lr_warmup_ratio 0 \
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable \
  --ckpt.output_dir "$OUT" --logger.tensorboard_dir "$OUT/tensorboard"
