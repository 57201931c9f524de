#!/usr/bin/env bash
# trace-rl train on one machine under torchrun, disaggregated: TRAINERS trainer ranks (Megatron,
# layout from dist.tp / dist.ep, the rest data parallel) and ENGINES rollout-engine ranks.
# gloo on the CPU, NCCL between trainer ranks when each has a GPU.
#
#   launch/local.sh                                  # 2 trainers + 1 engine, the embedded default
#   TRAINERS=4 ENGINES=1 launch/local.sh --set dist.ep=2 --set rl.steps=100
#
# Everything after the script's name goes to `trace-rl train` (--config, --set ...).
set -euo pipefail
TRAINERS=${TRAINERS:-2}
ENGINES=${ENGINES:-1}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$((TRAINERS + ENGINES))" \
    -m megatron_trace.cli train --set "dist.engine_ranks=$ENGINES" "$@"
