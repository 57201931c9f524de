"""SGLang running TRACE's FP4 policy on a GPU: the same checks as on the CPU, on CUDA.

    bash .sgl/run.sh bench/sglang_gpu_check.py     # on the GPU machine (bench/gpu_sglang.sh)

The tiny Qwen3-MoE with experts of 64 (seeded random weights): SGLang FP4 (guidance on every
layer) and BF16 engines generate; the built-in engine on CUDA scores the same tokens; every
site's precision as SGLang built it; engine start and generate times. Prints one JSON line a
case.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from megatron_trace.rl.metrics import mismatch_metrics
    from sglang_rollout.engine import EngineConfig as BuiltinConfig
    from sglang_rollout.engine import TraceEngine
    from sglang_rollout.sglang import EngineConfig, SGLangEngine
    from tests.sglang_rollout.sglang import test_sglang as t

    print("device", torch.cuda.get_device_name(), flush=True)
    sd = t.sc.random_full_state_dict(t.CFG, seed=21)
    for precision, guide in (("fp4", "all"), ("bf16", "none")):
        t0 = time.perf_counter()
        engine = SGLangEngine(t.CFG, EngineConfig(precision=precision, guide=guide, device="cuda"))
        start = time.perf_counter() - t0
        engine.update_weights(sd, 0)
        t0 = time.perf_counter()
        out = engine.generate(t.REQUESTS, t.SAMPLING)
        seconds = time.perf_counter() - t0
        table = engine.quantization_table()
        engine.shutdown()
        builtin = TraceEngine(t.CFG, BuiltinConfig(precision=precision, block_size=16, num_blocks=64, device="cuda"))
        builtin.update_weights(sd, 0)
        scored = [builtin.score(list(t.REQUESTS[int(s.group_id[1])].prompt_ids) + s.tokens)[s.prompt_len - 1:]
                  for s in out.samples]
        m = mismatch_metrics(scored, [s.logprobs for s in out.samples])
        counts = {p: sum(v == p for v in table.values()) for p in ("fp4", "bf16")}
        print(json.dumps({"precision": precision, "engine_start_s": round(start, 1), "generate_s": round(seconds, 2),
                          "tokens": sum(len(s.tokens) for s in out.samples), "sites": counts,
                          "records": len(out.guidance.samples[out.samples[0].sample_id].records),
                          "vs_builtin": {k: m[k] for k in ("k3_kl", "train_rollout_logprob_abs_diff")}}), flush=True)


if __name__ == "__main__":
    main()
