#!/usr/bin/env bash
# What one GPU session runs (device tool, H200): install this package beside the image's
# torch/triton, run the kernel tests on the GPU, then the recorded benchmarks.
#   bash bench/gpu_session.sh            # wheels for missing packages in .whl/
source bench/gpu_setup.sh
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -m pytest -q -p no:cacheprovider tests/kernels "$@" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 25
python3 bench/fp4_quantize.py --record 2>&1 | tee "$OUT/bench_fp4.log" | grep -v '%|'
cp bench/results/* "$OUT/" 2>/dev/null || true
