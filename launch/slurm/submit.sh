#!/usr/bin/env bash
# Render a run's sbatch script from its config (trace-rl slurm) and submit it.
#
#   launch/slurm/submit.sh launch/configs/qwen3-30b-a3b.yaml                 # disaggregated, 1 node
#   launch/slurm/submit.sh launch/configs/tiny.yaml                          # colocated: 1 GPU
#   launch/slurm/submit.sh my.yaml --set cluster.nodes=12 --set dist.ep=32   # overrides reach every task
#
# The script lands in $TRACE_JOBS (default: jobs/) for the record. The layout comes from the config
# (dist.* and cluster.*), which every task reads again: script and run cannot disagree.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [--set section.key=value ...]" >&2; exit 2; }
config=$1; shift
jobs=${TRACE_JOBS:-jobs}
mkdir -p "$jobs"
out="$jobs/$(basename "$config" .yaml)-$(date +%Y%m%d-%H%M%S).sbatch"
"${PYTHON:-python}" -m megatron_trace.cli plan --config "$config" "$@"
"${PYTHON:-python}" -m megatron_trace.cli slurm --config "$config" "$@" --out "$out"
exec sbatch "$out"
