#!/usr/bin/env bash
# The trainer step (bench/train_step.py) of this tree against an earlier commit's, alternating on
# one GPU machine, so a change is measured against its baseline in one run (device tool):
#   here: rm -rf .ab && mkdir .ab && git archive REV megatron_trace kernels sglang_rollout launch \
#           tools setup.cfg pyproject.toml bench/train_step.py | tar -x -C .ab
#   run:  bash bench/gpu_train_step_ab.sh [bench/train_step.py options]   (carry [".whl", ".ab"])
# Default options: the Qwen3-30B-A3B shape of train_step_fusions_2026-12-06_h100.md (4 layers,
# 16384 tokens, bf16 / fp4-rne / fp4-guided, 1 and 4 micro-batches). Environment: REPS (pairs of
# runs, 2), STOP_AT (seconds after which no new run starts, 470), KERNEL_TESTS=1 runs the FP4
# kernel tests first, KEEP_SITE=1 keeps the /tmp/site an earlier step installed (TE's, from
# `bash bench/gpu_te.sh install`) instead of installing afresh. Logs: $OUT/train_step_{new,old}_<rep>.log.
T0=$SECONDS
if [ "${KEEP_SITE:-0}" = 1 ]; then
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
else
  source bench/gpu_setup.sh
fi
[ -f .ab/setup.cfg ] || { echo ".ab/ is missing: make it with git archive (see the header)"; exit 2; }
if [ "${KERNEL_TESTS:-0}" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/fp4/test_partial_guidance.py \
    tests/kernels/fp4/test_gpu.py 2>&1 | tee "$OUT/pytest_kernels.log" | tail -n 6
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site_ab ./.ab >/dev/null || exit 1
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--model qwen3-30b-a3b --layers 4 --tokens 16384 --seq-len 2048
                               --modes bf16,fp4-rne,fp4-guided --micro-batches 1,4)
for rep in $(seq "${REPS:-2}"); do
  for side in new old; do
    if [ $((SECONDS - T0)) -ge "${STOP_AT:-470}" ]; then echo "not started: $side $rep ($((SECONDS - T0)) s)"; continue; fi
    if [ $side = old ]; then path=/tmp/site_ab:/tmp/site; script=.ab/bench/train_step.py
    else path=/tmp/site; script=bench/train_step.py; fi
    # the log keeps every line; only the echo here leaves out progress bars and warnings
    PYTHONPATH=$path timeout 240 python3 "$script" "${args[@]}" 2>&1 | tr '\r' '\n' \
      | tee "$OUT/train_step_${side}_$rep.log" | grep -v -e '%|' -e 'warn' | tail -n 14
    echo "$side $rep: exit status ${PIPESTATUS[0]} (124: past its 240 s) at $((SECONDS - T0)) s"
  done
done
