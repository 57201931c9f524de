"""Full-size FP4 layers on one GPU through SGLang: an engine TRACE starts creates its FP4 sites
packed (sglang_rollout/sglang/quant.py `packed_at_start`), so it starts models whose BF16
weights the GPU could not hold.

    bash .sgl/run.sh bench/sglang_full_size_start.py --out $OUT/sglang_full_size_start.json   # GPU machine

Each case is a preset at its real widths cut to `layers` layers (Qwen3-235B-A22B: 128 experts of
1536 x 4096; DeepSeek-V3: MLA, 256 experts of 2048 x 7168, 3 dense layers first), started with
`SGLangEngine` (the server arguments `trace-rl train` gives it, SGLang's dummy weights), then one
short rollout. A thread polls the device's used memory every 2 ms (SGLang's scheduler is another
process; its caching allocator keeps what it reserved, so peaks stay visible). Reported per case:
the plan's FP4 weights and what the same layers weigh in BF16 (`engine_weight_bytes`), the peak
used over the start and the rollout, and torch's allocator figures in the scheduler
(`SGLangEngine.memory`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GiB = 1024**3


def case(preset: str, layers: int, guide: str, torch) -> dict:
    from sglang_workspace import PeakUsed, used

    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.architecture import Architecture
    from megatron_trace.rl.plan_sglang import engine_weight_bytes
    from megatron_trace.rollout import GroupRequest, SamplingParams
    from sglang_rollout.sglang import EngineConfig, SGLangEngine

    cfg = PRESETS[preset].replace(num_layers=layers)
    arch = Architecture.from_model_config(preset, cfg)
    before = used(torch)
    t0 = time.perf_counter()
    with PeakUsed(torch) as start_peak:
        engine = SGLangEngine(cfg, EngineConfig(precision="fp4", guide=guide, device="cuda", num_blocks=256,
                                                block_size=16))
    start_s = time.perf_counter() - t0
    try:
        after_start = used(torch)
        # one small tensor makes the weights version 0; the FP4 sites stay zero codes (the timing and
        # memory are those of any weights)
        engine.update_weights({"decoder.final_layernorm.weight": torch.ones(cfg.hidden_size, dtype=torch.bfloat16)},
                              0)
        g = torch.Generator().manual_seed(0)
        requests = [GroupRequest(f"g{i}", tuple(torch.randint(0, cfg.vocab_size, (64,), generator=g).tolist()), n=2)
                    for i in range(4)]
        t0 = time.perf_counter()
        with PeakUsed(torch) as rollout_peak:
            out = engine.generate(requests, SamplingParams(max_new_tokens=16, seed=1))
        rollout_s = time.perf_counter() - t0
        scheduler = engine.memory()[0]
    finally:
        engine.shutdown()
    return {"case": f"{preset}:{layers}", "guide": guide, "start_s": round(start_s, 1),
            "rollout_s": round(rollout_s, 1), "response_tokens": sum(len(s.tokens) for s in out.samples),
            "plan_fp4_weights_gib": engine_weight_bytes(arch, 1, True) / GiB,
            "bf16_weights_gib": engine_weight_bytes(arch, 1, False) / GiB,
            "gpu_gib": torch.cuda.get_device_properties(0).total_memory / GiB,
            "start_peak_used_gib": (start_peak.peak - before) / GiB,
            "after_start_used_gib": (after_start - before) / GiB,
            "rollout_peak_used_gib": (rollout_peak.peak - before) / GiB,
            "scheduler_allocated_peak_gib": scheduler["peak"] / GiB, "scheduler_allocated_gib": scheduler["now"] / GiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="qwen3-235b-a22b:40:deep:4,deepseek-v3:12:deep:4",
                    help="preset:layers:guide, comma-separated (guide: the engine's guidance policy)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    torch.cuda.init()
    rows = []
    for spec in args.cases.split(","):
        preset, layers, guide = spec.split(":", 2)
        try:
            rows.append(case(preset, int(layers), guide, torch))
        except Exception as e:  # noqa: BLE001 (a failing case is reported, the others still run)
            rows.append({"case": f"{preset}:{layers}", "error": f"{type(e).__name__}: {e}"[-2000:]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
              "cases": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
