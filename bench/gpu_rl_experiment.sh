#!/usr/bin/env bash
# The headline RL experiment (bench/rl_experiment.py: SFT of the moe-0.4b preset on the chain
# task, GRPO in six modes x three seeds, evaluation of the final policies) on one H200 (device
# tool, kind nvidia-h200), one call at a time:
#   bash bench/gpu_rl_experiment.sh [TIME_LIMIT_S] [more bench/rl_experiment.py options]
#   e.g. bash bench/gpu_rl_experiment.sh 560 --parallel 4 --seeds 0   (run with timeout_s=600)
#        bash bench/gpu_rl_experiment.sh 560 --modes bf16,trace-all --seeds 0
# --parallel N trains N runs at once (each a process on the one GPU: a 0.4 B model leaves it
# mostly idle, the steps are host-bound). Each takes 14-19 GB of GPU memory (2026-12-06: five at
# once ran out on an 80 GB H100, four fit): --parallel 4 on an H100, 6 on an H200. A seed's modes
# share one SFT model only when they are trained on one machine (GPU SFT is not bitwise
# reproducible): give each fresh machine whole seeds.
# It stops cleanly TIME_LIMIT_S seconds (default 540) after it starts, setup included: a trainer
# still running then is stopped and resumes from its checkpoint at the next call. The run
# directories live in runs/rl_experiment/ (ignored by git: it survives between calls while the
# machine stays warm). Everything finished so far goes to $OUT: rl_experiment_<date>_gpu.{md,json,png}
# and rl_experiment.log. Copy the .json into bench/results/ before the next call: on a fresh
# machine the newest bench/results/rl_experiment_*_gpu.json is read back (--resume-from), so
# finished runs and evaluations are not redone (the SFT is, once per fresh machine).
# Exit status: 0 when the experiment is complete, 3 when the time limit stopped it (call again),
# 1 when a trainer or tool failed (its log's tail is printed).
LIMIT=${1:-540}
shift 2>/dev/null || true
source bench/gpu_setup.sh
python3 -c 'import torch, triton, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__)'
export OMP_NUM_THREADS=2  # per process: up to --parallel trainers share the 16 cores
# The --parallel trainers are separate CUDA processes: without MPS the GPU time-slices between
# them (2026-12-04: FP4 rollouts at 410-500 tokens/s each, six at once). MPS=1 (the default) starts
# NVIDIA's MPS daemon so their kernels run side by side; if it is missing or a CUDA process then
# fails to start, the daemon is stopped and the run goes on without it (the log says which).
# Measured 2026-12-06 (H100, MPS on, four to six at once): FP4 modes 1.7-3.2 s a step (trace-sparse
# 11.7 s) against 14-16 s (23.6 s) time-sliced (H200, six at once, 12-04).
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d
  if timeout 120 python3 -c 'import torch; torch.ones(1, device="cuda").sum().item()'; then
    echo "MPS: on"
  else
    echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS: a CUDA process failed under it; off"; tail -n 5 /tmp/mps-log/control.log 2>/dev/null
  fi
else
  echo "MPS: off (MPS=${MPS:-1}; nvidia-cuda-mps-control $(command -v nvidia-cuda-mps-control >/dev/null && echo found || echo 'not found'))"
fi
resume=()
# the newest by its name (dated; C collation: 2026-12-04b after 2026-12-04): a fresh checkout
# gives every file the same mtime, and the GPU machine's locale sorts "04_gpu" after "04b_gpu"
latest=${RESUME:-$(ls bench/results/rl_experiment_*_gpu.json 2>/dev/null | LC_ALL=C sort | tail -n 1)}
if [ -n "$latest" ]; then resume=(--resume-from "$latest"); echo "resuming from $latest"; fi
left=$((LIMIT - SECONDS))
python3 bench/rl_experiment.py --time-limit "$left" --runs runs/rl_experiment --out "$OUT" "${resume[@]}" "$@" \
  2>&1 | tr '\r' '\n' | grep --line-buffered -v -e '%|' -e 'warnings.warn' -e 'UserWarning' | tee "$OUT/rl_experiment.log"
rc=${PIPESTATUS[0]}
df -h runs/ | tail -n 1
du -sh runs/rl_experiment 2>/dev/null
case "$rc" in 0) what=complete ;; 3) what="stopped at the time limit: call again" ;; *) what=failed ;; esac
echo "bench/rl_experiment.py exit status $rc ($what)"
exit "$rc"
