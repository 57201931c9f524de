#!/usr/bin/env bash
# Nsight Compute on the FP4 decode kernels (device tool; carry [".whl"]): why they read at about
# half the copy bandwidth. One profiled launch of each, at bench/decode_kernels.py's shapes
# (Qwen3-30B-A3B, batch 64, 8k context): issue and pipe utilisation, warp stall reasons, the
# hottest SASS lines by stall, and the memory traffic. KERNELS narrows (default: both FP4 kernels
# and the BF16 attention they are compared with). Reports: $OUT/ncu_<kernel>.txt.
#   bash bench/gpu_decode_ncu.sh
source bench/gpu_setup.sh
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats
          --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section InstructionStats --section SourceCounters)
for spec in ${KERNELS:-fp4_grouped_gemm:fc1 fp4_decode_split:attention _split_kernel:attention}; do
  kernel=${spec%%:*} only=${spec##*:}
  # --clock-control none: the clocks stay as the machine runs them (METHOD.md)
  timeout 200 ncu --clock-control none -k "regex:^${kernel}\$" -c 1 "${sections[@]}" \
    python3 bench/decode_kernels.py --only "$only" > "$OUT/ncu_${kernel}.txt" 2>&1
  echo "$kernel: exit status $? ($(wc -l < "$OUT/ncu_${kernel}.txt") lines)"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|Stall" \
    "$OUT/ncu_${kernel}.txt" | head -n 20
done
