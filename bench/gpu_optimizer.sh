#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200) for issue 22's figures: the training step with Megatron's
# distributed optimizer against the replaced FP32-master AdamW, and the sharded weight sync's time
# and bytes, both at the Qwen3-30B-A3B shape with 4 layers.
#   bash bench/gpu_optimizer.sh      # wheels (megatron-core, torchao) in .whl/
source bench/gpu_setup.sh
python3 bench/optimizer_step.py ${OPT_ARGS:---model qwen3-30b-a3b --layers 4 --tokens 16384 --seq-len 2048 --record} \
  2>&1 | tee "$OUT/optimizer_step.log" | grep -v -e Warning -e warnings.warn
python3 bench/weight_sync.py ${SYNC_ARGS:---model qwen3-30b-a3b --layers 4 --record} \
  2>&1 | tee "$OUT/weight_sync.log" | grep -v -e Warning -e warnings.warn
cp bench/results/optimizer_step_* bench/results/weight_sync_* "$OUT/" 2>/dev/null || true
