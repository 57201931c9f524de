#!/usr/bin/env bash
# SGLang running TRACE's FP4 policy on the GPU machine (device tool, nvidia-h200). The SGLang
# bundle (59 MiB) and the project together exceed one call's 64 MiB, so it takes two calls:
#   bash bench/sglang_h200/build_bundle.sh .sgl   # here, once (ignored by git: .git/info/exclude)
#   mkdir -p .sglrun && cp .sgl/run.sh .sgl/sitecustomize.py .sglrun/
#   call 1, carry [".sgl"]:            bash bench/gpu_sglang.sh install
#   call 2, carry [".sglrun", ".whl"]: bash bench/gpu_sglang.sh check test   (.whl: megatron-core, torchao)
# install keeps SGLang in /tmp/sglsite on the warm machine; check runs bench/sglang_gpu_check.py,
# test the SGLang tests on CUDA (tests/sglang_rollout/sglang/), smoke a 2-layer throughput run of
# each engine, bench the throughput at Qwen3-30B-A3B's shape (bench/sglang_throughput.py; ENGINES
# picks them, BENCH_ARGS adds options). Logs and JSON lines go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for step in "$@"; do
  case $step in
    install)
      bash .sgl/run.sh -c 'print("sglang installed")' ;;
    check|test|smoke|bench)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/*.whl >/dev/null 2>&1
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . >/dev/null 2>&1
      export PYTHONPATH=/tmp/site SGL_SKIP_INSTALL=1
      if [ "$step" = smoke ] || [ "$step" = bench ]; then
        extra=""; [ "$step" = smoke ] && extra="--layers 2 --batch 8 --generate 32:16 --decode 256 --decode-tokens 16"
        for engine in ${ENGINES:-bf16 fp8 trace_fp4}; do
          timeout "${ENGINE_TIMEOUT:-300}" bash .sglrun/run.sh bench/sglang_throughput.py --engine "$engine" $extra ${BENCH_ARGS:-} \
            --out "$OUT/sglang_$step.jsonl" > "$OUT/sglang_${step}_$engine.log" 2>&1
          echo "$engine rc=$?"; grep '^{' "$OUT/sglang_${step}_$engine.log" | tail -n 4; grep -m3 -E 'Error|error:' "$OUT/sglang_${step}_$engine.log"
        done
      elif [ "$step" = check ]; then
        bash .sglrun/run.sh bench/sglang_gpu_check.py > "$OUT/sglang_gpu_check.log" 2>&1; grep '^{' "$OUT/sglang_gpu_check.log"
      else
        bash .sglrun/run.sh -m pytest -q -p no:cacheprovider -rs tests/sglang_rollout/sglang > "$OUT/pytest_sglang_gpu.log" 2>&1
        tail -n 3 "$OUT/pytest_sglang_gpu.log"
      fi ;;
    *) echo "unknown step $step (install, check, test, smoke, bench)"; exit 2 ;;
  esac
done
