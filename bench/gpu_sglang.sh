#!/usr/bin/env bash
# SGLang running TRACE's FP4 policy on the GPU machine (device tool, nvidia-h200). The SGLang
# bundle (56 MiB, with torch_memory_saver) and megatron-core's wheel fit beside the project in one call:
#   bash bench/sglang_h200/build_bundle.sh .sgl   # here, once (ignored by git: .gitignore)
#   carry [".sgl", ".whl/megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"]:
#     bash bench/gpu_sglang.sh install test export train
# A later call on the warm machine may carry .sglrun (run.sh and sitecustomize.py alone) instead of .sgl.
# `cache` saves the compiled kernels into $OUT (bench/gpu_cache.sh); carried back as .gpucache/ (with
# .sglrun: .sgl and the caches do not fit one call), `install` restores them on a fresh machine.
# SGLang compiles its Marlin kernels (ModelOpt NVFP4 weight-only on Hopper) with nvcc at first use, for
# minutes; .sgljit, built here by bench/sglang_h200/prebuild_jit.py, carries them ready (TVM_FFI_CACHE_DIR).
# install keeps SGLang in /tmp/sglsite on the warm machine; check runs bench/sglang_gpu_check.py,
# test the SGLang tests on CUDA (tests/sglang_rollout/sglang/, TESTS narrows them; stopped at TEST_TIMEOUT s), smoke a 2-layer
# throughput run of each engine, bench the throughput at Qwen3-30B-A3B's shape
# (bench/sglang_throughput.py; ENGINES picks them, BENCH_ARGS adds options; on an 80 GB H100 the 48-layer
# BF16 engine cannot hold the 8k batch's KV cache and runs in waves: BENCH_ARGS="--layers 24" fits all four),
# export SGLang's own
# loaders on TRACE's FP4 exports (bench/sglang_export_check.py; EXPORT_ARGS adds options), train `trace-rl train` colocated
# on the built-in engine and on SGLang, step split (bench/sglang_train_step.py; TRAIN_RUNS picks
# the models), workspace SGLang's activation + CUDA-graph memory for `trace-rl plan`
# (bench/sglang_workspace.py; WORKSPACE_ARGS adds options), fullsize full-width layers whose BF16 weights
# exceed the GPU (bench/sglang_full_size_start.py; FULLSIZE_ARGS adds options). Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for step in "$@"; do
  case $step in
    install)  # with a carried .gpucache (bench/gpu_cache.sh), the kernels compiled on an earlier machine
      bash bench/gpu_cache.sh restore
      bash .sgl/run.sh -c 'print("sglang installed")' ;;
    check|test|smoke|bench|export|train|workspace|fullsize)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/*.whl >/dev/null 2>&1
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . >/dev/null 2>&1
      export PYTHONPATH=/tmp/site SGL_SKIP_INSTALL=1
      [ -d .sgljit ] && export TVM_FFI_CACHE_DIR=$PWD/.sgljit
      run=.sglrun/run.sh; [ -f .sgl/run.sh ] && run=.sgl/run.sh
      if [ "$step" = smoke ] || [ "$step" = bench ]; then
        extra=""; [ "$step" = smoke ] && extra="--layers 2 --batch 8 --generate 32:16 --decode 256 --decode-tokens 16"
        for engine in ${ENGINES:-bf16 fp8 trace_fp4}; do
          timeout "${ENGINE_TIMEOUT:-300}" bash $run bench/sglang_throughput.py --engine "$engine" $extra ${BENCH_ARGS:-} \
            --out "$OUT/sglang_$step.jsonl" > "$OUT/sglang_${step}_$engine.log" 2>&1
          echo "$engine rc=$?"; grep '^{' "$OUT/sglang_${step}_$engine.log" | tail -n 4; grep -m3 -E 'Error|error:' "$OUT/sglang_${step}_$engine.log"
        done
      elif [ "$step" = check ]; then
        bash $run bench/sglang_gpu_check.py > "$OUT/sglang_gpu_check.log" 2>&1; grep '^{' "$OUT/sglang_gpu_check.log"
      elif [ "$step" = workspace ]; then
        bash $run bench/sglang_workspace.py ${WORKSPACE_ARGS:-} --out "$OUT/sglang_workspace.json" \
          > "$OUT/sglang_workspace.log" 2>&1
        grep '^{' "$OUT/sglang_workspace.log"; tail -n 5 "$OUT/sglang_workspace.log"
      elif [ "$step" = fullsize ]; then
        bash $run bench/sglang_full_size_start.py ${FULLSIZE_ARGS:-} --out "$OUT/sglang_full_size_start.json" \
          > "$OUT/sglang_full_size_start.log" 2>&1
        grep '^{' "$OUT/sglang_full_size_start.log"; tail -n 5 "$OUT/sglang_full_size_start.log"
      elif [ "$step" = export ]; then
        bash $run bench/sglang_export_check.py --out "$OUT/sglang_export_check.json" ${EXPORT_ARGS:-} > "$OUT/sglang_export_check.log" 2>&1
        tail -n 30 "$OUT/sglang_export_check.log"
      elif [ "$step" = train ]; then
        for spec in ${TRAIN_RUNS:-demo:0:5:200 qwen3-30b-a3b:4:4:0}; do  # model:layers:RL steps:SFT steps
          IFS=: read -r model layers steps sft <<< "$spec"
          bash $run bench/sglang_train_step.py --model "$model" --layers "$layers" --steps "$steps" \
            --sft-steps "$sft" --out "$OUT/train_step_${model}_${layers}l.json" \
            > "$OUT/train_step_${model}_${layers}l.log" 2>&1
          tail -n 6 "$OUT/train_step_${model}_${layers}l.log"
        done
      else
        # SIGINT at TEST_TIMEOUT: pytest then still prints which tests failed and why (a kill would not)
        timeout -s INT -k 30 "${TEST_TIMEOUT:-520}" bash $run -m pytest -q -p no:cacheprovider -rfs \
          ${TESTS:-tests/sglang_rollout/sglang} > "$OUT/pytest_sglang_gpu.log" 2>&1
        tail -n 15 "$OUT/pytest_sglang_gpu.log"
      fi ;;
    cache)  # the kernel caches into $OUT/gpu_cache.tar.gz: copy it into .gpucache/ here for the next machine
      bash bench/gpu_cache.sh save ;;
    *) echo "unknown step $step (install, check, test, smoke, bench, export, train, workspace, fullsize, cache)"; exit 2 ;;
  esac
done
