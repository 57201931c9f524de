#!/usr/bin/env bash
# SGLang running TRACE's FP4 policy on the GPU machine (device tool, nvidia-h200). The SGLang
# bundle (59 MiB) and the project together exceed one call's 64 MiB, so it takes two calls:
#   bash bench/sglang_h200/build_bundle.sh .sgl   # here, once (ignored by git: .git/info/exclude)
#   mkdir -p .sglrun && cp .sgl/run.sh .sgl/sitecustomize.py .sglrun/
#   call 1, carry [".sgl"]:            bash bench/gpu_sglang.sh install
#   call 2, carry [".sglrun", ".whl"]: bash bench/gpu_sglang.sh check test   (.whl: megatron-core, torchao)
# install keeps SGLang in /tmp/sglsite on the warm machine; check runs bench/sglang_gpu_check.py,
# test the SGLang tests on CUDA (tests/sglang_rollout/sglang/). Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for step in "$@"; do
  case $step in
    install)
      bash .sgl/run.sh -c 'print("sglang installed")' ;;
    check|test)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/*.whl >/dev/null 2>&1
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . >/dev/null 2>&1
      export PYTHONPATH=/tmp/site SGL_SKIP_INSTALL=1
      if [ "$step" = check ]; then
        bash .sglrun/run.sh bench/sglang_gpu_check.py > "$OUT/sglang_gpu_check.log" 2>&1; grep '^{' "$OUT/sglang_gpu_check.log"
      else
        bash .sglrun/run.sh -m pytest -q -p no:cacheprovider -rs tests/sglang_rollout/sglang > "$OUT/pytest_sglang_gpu.log" 2>&1
        tail -n 3 "$OUT/pytest_sglang_gpu.log"
      fi ;;
    *) echo "unknown step $step (install, check, test)"; exit 2 ;;
  esac
done
