#!/usr/bin/env bash
# What one GPU session runs (device tool, H200): install this package beside the image's
# torch/triton, run the kernel tests on the GPU, then the recorded benchmarks.
#   bash bench/gpu_session.sh            # wheels for missing packages in .whl/
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -m pytest -q -p no:cacheprovider tests/kernels "$@" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 25
python3 bench/fp4_quantize.py --record 2>&1 | tee "$OUT/bench_fp4.log" | grep -v '%|'
cp bench/results/* "$OUT/" 2>/dev/null || true
