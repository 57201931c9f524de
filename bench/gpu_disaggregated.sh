#!/usr/bin/env bash
# Disaggregated trace-rl train on GPUs (device tool, kind nvidia-h200-x2), a short embedded-default
# run three ways; results under $OUT:
#   disagg:      2 trainer ranks (EP2 over NCCL, one per GPU) + 1 engine rank sharing GPU 0
#                (the bridge falls back to gloo: NCCL cannot hold two ranks of one GPU)
#   nccl_bridge: 1 trainer rank (GPU 0) + 1 engine rank (GPU 1), bridge on NCCL
#   colocated:   one process, one GPU
#   run: bash bench/gpu_disaggregated.sh      (carry .whl)
source bench/gpu_setup.sh
export OMP_NUM_THREADS=4
common=(--set sft.steps=300 --set rl.steps=6 --set rl.prompts_per_step=16 --set checkpoint.every=3)
TRAINERS=2 ENGINES=1 PYTHON=python3 bash launch/local.sh --set dist.ep=2 "${common[@]}" \
    --set output_dir="$OUT/disagg" > "$OUT/disagg.log" 2>&1
echo "disagg rc=$?"; tail -3 "$OUT/disagg.log"
TRAINERS=1 ENGINES=1 PYTHON=python3 bash launch/local.sh --set dist.bridge=nccl "${common[@]}" \
    --set output_dir="$OUT/nccl_bridge" > "$OUT/nccl_bridge.log" 2>&1
echo "nccl_bridge rc=$?"; tail -3 "$OUT/nccl_bridge.log"
python3 -m megatron_trace.cli train "${common[@]}" --set output_dir="$OUT/colocated" > "$OUT/colocated.log" 2>&1
echo "colocated rc=$?"; tail -2 "$OUT/colocated.log"
rm -rf "$OUT"/*/checkpoints "$OUT"/*/tb
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
for run in ("disagg", "nccl_bridge", "colocated"):
    p = f"{out}/{run}/metrics.jsonl"
    if os.path.exists(p):
        for line in open(p):
            r = json.loads(line)
            print(run, r["step"], f"reward {r['reward']:.3f} k3 {r['k3_kl']:.2e} step_s {r['step_s']:.2f} "
                  f"rollout_s {r['rollout_s']:.2f} train_s {r['train_s']:.2f} sync_s {r['sync_s']:.2f}")
PY
