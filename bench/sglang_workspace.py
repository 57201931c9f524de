"""The activation + CUDA-graph workspace of one SGLang engine GPU, measured for `trace-rl plan`
(megatron_trace/rl/plan_sglang.py WORKSPACE_BYTES).

    bash .sglrun/run.sh bench/sglang_workspace.py --out $OUT/sglang_workspace.json   # GPU machine

Each case starts TRACE's SGLang backend (`SGLangEngine`, the server arguments `trace-rl train`
gives it) on Qwen3-30B-A3B's shape cut to `--layers` layers, alone on the GPU, keeps SGLang's
random (dummy) weights and runs one RL-shaped rollout (`--groups` prompts of `--prompt` tokens,
`--n` samples each, `--new` tokens). A thread polls the GPU's used memory (torch.cuda.mem_get_info, device-wide:
SGLang's scheduler is another process) every 2 ms; SGLang's caching allocator keeps what it
reserved, so the peak stays visible between polls. Then

    workspace = peak used - used before the engine - the plan's weights - the plan's KV pool

the plan's weights and KV pool being `engine_weight_bytes` and tokens x TRACE's bytes per token,
i.e. exactly what the plan adds WORKSPACE_BYTES to. The start's peak shows that no BF16 weights
are held at any point (FP4 sites are created packed: sglang_rollout/sglang/quant.py), and the
scheduler's own allocator figures (`SGLangEngine.memory`) are reported beside. Cases: FP4 with
guidance on every layer (TRACE turns CUDA graphs off), FP4 without guidance (decode CUDA graphs
on), BF16 (graphs on).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
CASES = {"fp4-guided": ("fp4", "all"), "fp4": ("fp4", "none"), "bf16": ("bf16", "none")}


class PeakUsed:
    """The device's peak used bytes while running, polled by a thread."""

    def __init__(self, torch, period_s: float = 0.002):
        self.torch, self.period_s, self.peak, self._stop = torch, period_s, 0, False
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop:
            free, total = self.torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def used(torch) -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def case(name: str, layers: int, args, torch) -> dict:
    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.architecture import Architecture
    from megatron_trace.rl.plan_sglang import engine_weight_bytes
    from megatron_trace.rollout import GroupRequest, SamplingParams
    from sglang_rollout.sglang import EngineConfig, SGLangEngine

    precision, guide = CASES[name]
    cfg = PRESETS["qwen3-30b-a3b"].replace(num_layers=layers)
    arch = Architecture.from_model_config("qwen3-30b-a3b", cfg)
    block = 16
    tokens = args.groups * args.n * (args.prompt + args.new)
    blocks = -(-tokens // block)
    before = used(torch)
    t0 = time.perf_counter()
    with PeakUsed(torch) as start_peak:
        engine = SGLangEngine(cfg, EngineConfig(precision=precision, guide=guide, device="cuda", num_blocks=blocks,
                                                block_size=block))
    start_s = time.perf_counter() - t0
    after_start = used(torch)
    # one small tensor makes the engine's weights version 0; the rest stay SGLang's dummy weights
    engine.update_weights({"decoder.final_layernorm.weight": torch.ones(cfg.hidden_size, dtype=torch.bfloat16)}, 0)
    g = torch.Generator().manual_seed(0)
    requests = [GroupRequest(f"g{i}", tuple(torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist()),
                             n=args.n) for i in range(args.groups)]
    sampling = SamplingParams(max_new_tokens=args.new, seed=1)
    t0 = time.perf_counter()
    with PeakUsed(torch) as rollout_peak:
        out = engine.generate(requests, sampling)
    rollout_s = time.perf_counter() - t0
    scheduler = engine.memory()[0]  # torch's allocator inside SGLang's scheduler process
    engine.shutdown()
    weights = engine_weight_bytes(arch, 1, precision == "fp4")
    heads, head = arch.kv_heads, arch.kv_width // (2 * arch.kv_heads)
    cell = layers * heads * 2 * (head // 2 + head // 16 + 4) if precision == "fp4" else layers * heads * 2 * head * 2
    kv = blocks * block * cell
    peak = max(start_peak.peak, rollout_peak.peak) - before
    return {"case": name, "layers": layers, "cuda_graphs": not (precision == "fp4" and guide != "none"),
            "kv_tokens": blocks * block, "start_s": round(start_s, 1), "rollout_s": round(rollout_s, 1),
            "response_tokens": sum(len(s.tokens) for s in out.samples),
            "plan_weights_gib": weights / GiB, "plan_kv_gib": kv / GiB,
            "scheduler_allocated_peak_gib": scheduler["peak"] / GiB, "scheduler_allocated_gib": scheduler["now"] / GiB,
            "start_peak_gib": (start_peak.peak - before) / GiB, "after_start_gib": (after_start - before) / GiB,
            "rollout_peak_gib": (rollout_peak.peak - before) / GiB, "peak_gib": peak / GiB,
            "workspace_gib": (rollout_peak.peak - before - weights - kv) / GiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="fp4-guided:4,fp4:4,bf16:4,fp4-guided:12",
                    help="case:layers, comma-separated; cases " + ", ".join(CASES))
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    torch.cuda.init()
    rows = []
    for spec in args.cases.split(","):
        name, layers = spec.split(":")
        try:
            rows.append(case(name, int(layers), args, torch))
        except Exception as e:  # noqa: BLE001 (a failing case is reported, the others still run)
            rows.append({"case": name, "layers": int(layers), "error": f"{type(e).__name__}: {e}"[-2000:]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "shape": {k: getattr(args, k) for k in ("groups", "n", "prompt", "new")}, "cases": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
