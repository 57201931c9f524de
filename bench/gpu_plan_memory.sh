#!/usr/bin/env bash
# One GPU: trace-rl plan against torch.cuda.max_memory_allocated of colocated RL steps.
#   (device tool) bash bench/gpu_plan_memory.sh      -> $OUT/plan_memory_*_h200.{json,md}
source bench/gpu_setup.sh
D=$(date +%F)
for args in "" "--set rl.mode=bf16"; do
  tag=$(echo "$args" | sed 's/--set rl\.//; s/[=.]/-/g; s/ //g'); tag=${tag:-trace}
  python3 bench/plan_memory.py $args --out "$OUT/plan_memory_${tag}_${D}_h200" 2>&1 | grep -v -i warn | tail -2
done
