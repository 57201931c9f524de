#!/usr/bin/env bash
# What one GPU session runs for the rollout engine (device tool, nvidia-h200): the FP4 GEMM and
# paged-attention kernel tests and the engine's CUDA-graph tests on the GPU, an engine generation
# on CUDA against the CPU engine, then bench/decode_kernels.py and bench/rollout_throughput.py.
#   bash bench/gpu_rollout.sh       # wheels (torchao, ...) in .whl/
#   ROLLOUT_ARGS="..." picks the throughput cases; ROLLOUT_TIMEOUT (s) stops the bench in time to copy its results
source bench/gpu_setup.sh
python3 -m pytest -q -p no:cacheprovider -rfEs tests/kernels/fp4/test_linear_attention.py tests/kernels/fp4/test_gpu.py tests/kernels/fp4/test_cuda_decode.py tests/kernels/test_norm_rope.py tests/kernels/test_moe_routing.py tests/kernels/test_fused_inputs.py \
  tests/sglang_rollout/engine/test_engine_gpu.py tests/sglang_rollout/engine/test_sampler.py tests/sglang_rollout/test_backend_contract.py > "$OUT/pytest_rollout_gpu.log" 2>&1; tail -n 3 "$OUT/pytest_rollout_gpu.log"
python3 - <<'PY' 2>&1 | tee "$OUT/engine_cuda.log"
import sys, torch
sys.path.insert(0, ".")
from tests.support.scenarios import random_full_state_dict
from megatron_trace.model_config import PRESETS
from megatron_trace.rollout import GroupRequest, SamplingParams
from sglang_rollout.engine import EngineConfig, TraceEngine
cfg = PRESETS["tiny"]; sd = random_full_state_dict(cfg)
reqs = [GroupRequest("g0", (1, 2, 3, 4, 5), n=3), GroupRequest("g1", tuple(range(7, 40)), n=2)]
outs = {}
for dev in ("cpu", "cuda"):
    e = TraceEngine(cfg, EngineConfig(precision="fp4", block_size=16, num_blocks=64, device=dev, guide="all"))
    e.update_weights(sd, 0)
    outs[dev] = e.generate(reqs, SamplingParams(max_new_tokens=16, temperature=0))
for a, b in zip(outs["cpu"].samples, outs["cuda"].samples):
    print(a.sample_id, "same greedy tokens:", a.tokens == b.tokens, "max |logprob diff|:",
          float((a.logprobs - b.logprobs).abs().max()) if a.tokens == b.tokens else None)
print("guidance bytes cpu/cuda:", outs["cpu"].guidance.nbytes, outs["cuda"].guidance.nbytes)
PY
python3 bench/decode_kernels.py --record 2>&1 | tee "$OUT/decode_kernels.log"
timeout "${ROLLOUT_TIMEOUT:-420}" python3 bench/rollout_throughput.py ${ROLLOUT_ARGS:---model qwen3-30b-a3b --steps 2 --warmup 1 --cuda-graphs --host-weights --memory-gib 60 --profile 64 --generate 64:128:128 --record} \
  2>&1 | tr '\r' '\n' | grep -v -e '%|' > "$OUT/rollout_throughput_$(date +%F)_h200.log"; grep "tokens/s" "$OUT/rollout_throughput_$(date +%F)_h200.log"
cp bench/results/rollout_throughput.* bench/results/decode_kernels_"$(date +%F)"_* "$OUT/" 2>/dev/null || true
