#!/usr/bin/env bash
# What one two-GPU session runs (device tool, nvidia-h200-x2) for the Megatron integration:
# the Megatron test file on NCCL (one GPU per rank), then the training-step benchmark on one GPU.
#   bash bench/gpu_megatron.sh      # wheels (megatron-core, torchao) in .whl/
source bench/gpu_setup.sh
python3 -c 'import torch, triton, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__)'
python3 -m pytest -q -p no:cacheprovider -rfEs tests/megatron_trace/megatron/test_model_qat.py \
  "tests/kernels/fp4/test_quantize.py::test_row_shards_with_the_whole_rows_amax_quantize_as_the_whole_rows" \
  2>&1 | tee "$OUT/pytest_megatron_gpu.log" | tail -n 15
python3 bench/train_step.py ${TRAIN_STEP_ARGS:---model qwen3-30b-a3b --layers 4 --tokens 16384 --seq-len 2048 --micro-batches 1,4 --steps 5 --warmup 2 --profile --record} \
  2>&1 | tee "$OUT/train_step.log" | grep -v -e '%|' -e Warning -e warnings.warn
cp bench/results/train_step.* "$OUT/" 2>/dev/null || true
