"""Weight sync time and bytes (rl.weight_sync): the trainer's weights quantized, packed into
buckets and written into a colocated FP4 engine, one process and one device.

The model has the preset's full width and `--layers` layers (BF16 trainer parameters). Each
sync quantizes every FP4 site with the shared quantizer, packs buckets of `--bucket-mb` MiB and
writes them into the engine in place. Reported: seconds per sync, bytes, the bytes' rate as a
fraction of the device copy bandwidth (measured in the same run: read + write of a copy),
the device memory the sync allocates beyond the two models (peak, against the bucket), and
whether the engine's codes equal quantizing each full tensor at once.

    python bench/weight_sync.py                                            # tiny model on the CPU
    python bench/weight_sync.py --model qwen3-30b-a3b --layers 4 --record   # on a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def copy_bytes_per_s(device: str, nbytes: int = 2**30) -> float:
    """This device's copy bandwidth, measured now: bytes read + written per second by a
    device-to-device copy of `nbytes` (median of 10)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=0, help="0: the preset's")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--record", action="store_true")
    args = p.parse_args()

    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.spawn import init_one_process
    from megatron_trace.megatron.trainer import MegatronTrainer
    from megatron_trace.model_config import FP4_WEIGHT_SUFFIXES, PRESETS
    from megatron_trace.rl.weight_sync import sync_weights
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from trace_kernels.fp4 import quantize

    init_one_process()
    cfg = PRESETS[args.model]
    cfg = cfg.replace(num_layers=args.layers) if args.layers else cfg
    cuda = torch.cuda.is_available()
    trainer = MegatronTrainer(build_model(cfg, "bf16", grouped_gemm=True), cfg)
    engine = TraceEngine(cfg, EngineConfig(precision="fp4", device="cuda" if cuda else "cpu", num_blocks=16,
                                           cuda_graph_max_batch=0))
    sync_weights(trainer, engine, 0, args.bucket_mb)  # warm-up: kernels compiled, allocator warm
    times, sent, peak = [], 0, 0
    for v in range(1, args.syncs + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        sent = sync_weights(trainer, engine, v, args.bucket_mb)
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - t0)
    params = {k: t for k, t in trainer.model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    exact = all(torch.equal(q.codes, engine.weights.tensors[k].codes)
                and torch.equal(q.global_scale, engine.weights.tensors[k].global_scale)
                for k, t in params.items() if k.endswith(FP4_WEIGHT_SUFFIXES) for q in [quantize(t.detach(), "nvfp4")])
    s = min(times)
    copy_bw = copy_bytes_per_s("cuda" if cuda else "cpu", 2**30 if cuda else 2**26)
    row = {"model": args.model, "layers": cfg.num_layers, "bucket_mb": args.bucket_mb, "sync_s": s,
           "sync_s_all": times, "bytes": sent, "bytes_per_s": sent / s,
           "copy_bytes_per_s": copy_bw, "copy_bandwidth_fraction": sent / s / copy_bw,
           "bf16_bytes": sum(t.numel() * 2 for t in params.values()),
           "peak_device_bytes_beyond_models": peak, "bucket_bytes": int(args.bucket_mb * 2**20),
           "codes_equal_full_tensor_quantize": exact, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "date": datetime.date.today().isoformat()}
    print(json.dumps(row, indent=1))
    if args.record:
        out = ROOT / "bench" / "results" / f"weight_sync_{row['date']}_{'h200' if cuda else 'cpu'}.json"
        out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
