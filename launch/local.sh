#!/usr/bin/env bash
# trace-rl train on one machine under torchrun, disaggregated: TRAINERS trainer ranks (Megatron,
# layout from dist.tp / dist.ep, the rest data parallel) and ENGINES rollout-engine ranks, one
# process each. An engine rank runs one engine of dist.engine_tp GPUs (SGLang's tp_size; the
# built-in engine runs on one): the trainers take GPUs 0 .. TRAINERS-1, engine rank e the
# dist.engine_tp GPUs after them (TRAINERS + e x engine_tp ...), so the machine needs
# TRAINERS + ENGINES x engine_tp GPUs (checked at start). gloo on the CPU, NCCL between trainer
# ranks when each has a GPU.
#
#   launch/local.sh                                  # 2 trainers + 1 engine, the embedded default
#   TRAINERS=4 ENGINES=1 launch/local.sh --set dist.ep=2 --set rl.steps=100
#   TRAINERS=1 ENGINES=1 launch/local.sh --set rollout.backend=sglang --set dist.engine_tp=2   # an SGLang TP2 engine
#
# Everything after the script's name goes to `trace-rl train` (--config, --set ...).
set -euo pipefail
TRAINERS=${TRAINERS:-2}
ENGINES=${ENGINES:-1}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$((TRAINERS + ENGINES))" \
    -m megatron_trace.cli train --set "dist.engine_ranks=$ENGINES" "$@"
