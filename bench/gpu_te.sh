#!/usr/bin/env bash
# Transformer Engine 2.20.2 on the GPU machine (device tool, nvidia-h200), for issue 26's GPU tests.
# First run on 2026-12-05 (bench/results/te_gpu_tests_2026-12-05a_h200.log, train_step_te_2026-12-05a_h200.*).
#   bash bench/te_h200/build_bundle.sh .te      # here, once
# TE's core wheel travels in pieces, one device call each, onto one warm machine (calls chained
# without a pause: an idle machine is given back after 30 s):
#   carry [".te/core.part00"]: bash bench/gpu_te.sh part      ... one call per piece (45 MiB + the tree's 14, under 64)
#   carry [".te/whl", ".te/SHA256", ".te/CORE_NAME", ".whl"]: bash bench/gpu_te.sh install diff test bench
# fp4 runs bench/fp4_quantize.py there too (the trainer's one-pass fake quantization, issue 28).
# install builds TE's torch extension (90 s on 16 cores) and returns its wheel in $OUT: put it in .te/ext/
# and carry that too, and later machines skip the build.
# part keeps what arrived (a warm machine keeps ignored folders, so .te/ fills up piece by piece);
# reinstall puts this package into /tmp/site again after a change (kernels/ is imported from there);
# install joins the pieces (checksum), installs TE's core and Python and the carried wheels into
# /tmp/site, builds the torch extension there (sm_90 only, MAX_JOBS=16) and imports
# transformer_engine.pytorch; test runs tests/megatron_trace/te (TESTS narrows) with TE real; bench
# times the training step on the TE spec against the local spec (bench/train_step.py --transformer-impl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
for step in "$@"; do
  case $step in
    part)
      ls -la .te/ ; du -sh .te ;;
    install)
      core=/tmp/te/$(cat .te/CORE_NAME); mkdir -p /tmp/te
      cat .te/core.part* > "$core" && (cd /tmp/te && sha256sum -c "$OLDPWD/.te/SHA256") || exit 1
      rm -rf /tmp/site; mkdir -p /tmp/site
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$core" .te/whl/*.whl .whl/*.whl || exit 1
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null || exit 1
      export PYTHONPATH=/tmp/site
      cudnn=$(python3 -c 'import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__))' 2>/dev/null || true)
      # FORCE_BUILD: setup.py would first try to download a prebuilt wheel from GitHub (no network there)
      export NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=16 NVTE_PYTORCH_FORCE_BUILD=TRUE \
        CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
      [ -n "$cudnn" ] && export CUDNN_PATH=$cudnn CPATH=$cudnn/include:${CPATH:-}
      # the extension's wheel: carried in .te/ext/ (built on an earlier machine), else built here;
      # unpacked into TE's package (pip --target would not merge it into an existing folder)
      ext=$(ls .te/ext/transformer_engine_torch-*.whl 2>/dev/null | head -n 1)
      if [ -z "$ext" ]; then
        mkdir -p /tmp/te/build /tmp/te/wheel && tar xzf .te/whl/transformer_engine_torch-2.20.2.tar.gz -C /tmp/te/build
        start=$SECONDS
        (cd /tmp/te/build/transformer_engine_torch-2.20.2 && \
          python3 -m pip wheel -v --no-index --no-deps --no-build-isolation -w /tmp/te/wheel .) \
          > "$OUT/te_build.log" 2>&1
        echo "transformer_engine_torch build rc=$? in $((SECONDS - start)) s"; tail -n 5 "$OUT/te_build.log"
        ext=$(ls /tmp/te/wheel/transformer_engine_torch-*.whl) && cp "$ext" "$OUT/"
      fi
      python3 -m zipfile -e "$ext" /tmp/site || exit 1
      python3 -c 'import transformer_engine.pytorch as te, transformer_engine; print("TE", transformer_engine.__version__, te.Linear)' ;;
    reinstall)  # this package again into the installed /tmp/site, after a change on a warm machine
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . >/dev/null 2>&1 \
        && echo "reinstalled trace into /tmp/site" ;;
    test)
      export PYTHONPATH=/tmp/site
      python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/megatron_trace/te} 2>&1 | tee "$OUT/te_tests.log" | tail -n 30 ;;
    diff)  # the first modules whose outputs differ between the TE and local specs, per mode
      export PYTHONPATH=/tmp/site
      python3 bench/te_h200/spec_diff.py 2>&1 | grep -v Warning | tee "$OUT/te_spec_diff.log" | tail -n 60 ;;
    bench)  # training step, TE spec vs local spec, Qwen3-30B-A3B shape (4 layers), in one process
      export PYTHONPATH=/tmp/site
      python3 bench/train_step.py --model qwen3-30b-a3b --layers 4 --tokens 16384 --seq-len 2048 \
        --modes bf16,fp4-rne,fp4-guided --transformer-impl local,transformer_engine --record ${PROFILE:+--profile} 2>&1 \
        | tr '\r' '\n' | grep -v '%|' | tee "$OUT/te_train_step.log" | tail -n 20
      cp bench/results/train_step_te.* "$OUT/" ;;
    fp4)  # the FP4 kernels beside it on the same machine: the trainer's one-pass fake quant, bit for bit and timed
      export PYTHONPATH=/tmp/site; touch /tmp/fp4_mark
      python3 bench/fp4_quantize.py --record 2>&1 | tr '\r' '\n' | grep -v '%|' | tee "$OUT/fp4_quantize.log" | tail -n 30
      find bench/results -name 'fp4_quantize_*' -newer /tmp/fp4_mark -exec cp {} "$OUT/" \; ;;
    *)
      echo "unknown step $step (part, install, reinstall, test, diff, bench, fp4)"; exit 2 ;;
  esac
done
