"""GPU check: an SGLang engine TRACE starts (FP4 sites created packed) with CUDA graphs on (no
guidance recorded) and torch_memory_saver (EngineConfig.release_memory) gives its memory back,
takes it again, receives the weights again and generates what it generated before.

    bash .sgl/run.sh bench/sglang_release_check.py --out $OUT/sglang_release_check.json   # GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 1024**3


def agreement(x, y) -> dict:
    """How many samples of two rollouts have the same tokens, and their largest log-prob difference."""
    pairs = [(a, b) for a, b in zip(x.samples, y.samples, strict=True) if a.tokens == b.tokens]
    worst = max((float((a.logprobs - b.logprobs).abs().max()) for a, b in pairs), default=None)
    return {"same_tokens": len(pairs), "of": len(x.samples), "largest_logprob_difference": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    from megatron_trace.model_config import PRESETS
    from megatron_trace.rollout import GroupRequest, SamplingParams
    from sglang_rollout.sglang import EngineConfig, SGLangEngine
    from tests.support import scenarios as sc

    cfg = PRESETS["qwen3-30b-a3b"].replace(num_layers=4)
    sd = sc.random_full_state_dict(cfg, seed=3)
    requests = [GroupRequest(f"g{i}", tuple(range(1 + i, 33 + i)), n=4) for i in range(4)]
    sampling = SamplingParams(max_new_tokens=32, seed=2)
    engine = SGLangEngine(cfg, EngineConfig(device="cuda", precision="fp4", guide="none", release_memory=True,
                                            num_blocks=4096))
    try:
        engine.update_weights(sd, 0)
        before = engine.generate(requests, sampling)
        again = engine.generate(requests, sampling)  # the control: two rollouts before any release
        free = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        freed = torch.cuda.mem_get_info()[0] - free
        engine.resume_memory()
        t0 = time.perf_counter()
        engine.update_weights(sd, 1)
        resend_s = time.perf_counter() - t0
        after = engine.generate(requests, sampling)
        memory = engine.memory()[0]
    finally:
        engine.shutdown()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
              "model": "qwen3-30b-a3b, 4 layers", "cuda_graphs": True, "freed_gib": freed / GiB,
              "scheduler_allocated_gib": memory["now"] / GiB, "resend_s": round(resend_s, 2),
              "second_rollout_vs_first": agreement(again, before),
              "after_resume_vs_first": agreement(after, before)}
    print(json.dumps(result), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
