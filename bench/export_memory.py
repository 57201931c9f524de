"""Peak memory of the streaming checkpoint tools against the checkpoint's size.

Writes a synthetic HF Qwen3-MoE checkpoint (random BF16, sized by --layers/--experts/--hidden),
then runs each tool in a fresh process that resets its peak-RSS counter after the imports
(/proc/self/clear_refs) and reports the peak above that baseline: `trace-export-fp4 --hf`
(ModelOpt layout, input scales from a file) and `trace-convert-megatron-to-hf` is not included
(it needs a Megatron checkpoint; the same ShardedWriter bounds it). The claim under test: peak
extra memory is about one output shard plus one tensor, however large the checkpoint.

    python bench/export_memory.py                       # ~1 GB checkpoint, 64 MB shards
    python bench/export_memory.py --layers 4 --experts 16 --hidden 256 --shard-mb 4 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys
from megatron_trace.checkpoint.cli import export_main
import torch, trace_kernels.fp4
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
base = status("VmRSS:")
export_main(sys.argv[1:])
print(json.dumps({"baseline_rss": base, "peak_rss": status("VmHWM:")}))
"""


def write_checkpoint(path: Path, layers: int, experts: int, hidden: int, shard_bytes: int) -> tuple[int, dict]:
    """A random BF16 HF checkpoint; returns (bytes of tensors, input-amax dict)."""
    import torch

    from megatron_trace.checkpoint.hf_layout import hf_config, hf_shapes
    from megatron_trace.checkpoint.safetensors_io import ShardedWriter
    from megatron_trace.model_config import ModelConfig

    cfg = ModelConfig(vocab_size=8192, hidden_size=hidden, num_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), head_dim=64, moe_intermediate_size=hidden,
                      num_experts=experts, top_k=2)
    g = torch.Generator().manual_seed(0)
    with ShardedWriter(path, shard_bytes) as w:
        for name, shape in hf_shapes(cfg).items():
            w.add(name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
        total = w.total_bytes + w.buffer_bytes
        w.close({"config.json": hf_config(cfg)})
    amax = {f"{L}.{s}": 4.0 for L in range(layers) for s in ("qkv", "proj", "fc1", "fc2")}
    return total, amax


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--shard-mb", type=int, default=64, help="output shard size (the memory bound's main term)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size, amax = write_checkpoint(tmp / "hf", args.layers, args.experts, args.hidden, 256 << 20)
        (tmp / "amax.json").write_text(json.dumps(amax))
        cmd = [sys.executable, "-c", _CHILD, "--hf", str(tmp / "hf"), "--out", str(tmp / "out"), "--format",
               "modelopt", "--input-amax", str(tmp / "amax.json"), "--max-shard-size", f"{args.shard_mb}MB"]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"export failed:\n{proc.stderr[-3000:]}")
        mem = json.loads(proc.stdout.strip().splitlines()[-1])
        out_bytes = sum(f.stat().st_size for f in (tmp / "out").glob("*.safetensors"))
    extra = mem["peak_rss"] - mem["baseline_rss"]
    row = {"tool": "trace-export-fp4 --hf (modelopt)", "checkpoint_bytes": size, "output_bytes": out_bytes,
           "shard_bytes": args.shard_mb << 20, "peak_extra_rss_bytes": extra,
           "checkpoint_over_peak": size / extra, "date": datetime.date.today().isoformat(),
           "machine": f"cpu ({os.cpu_count()} cores)",
           "command": "python bench/export_memory.py " + " ".join(argv or sys.argv[1:])}
    print(f"checkpoint {size / 2**20:.0f} MiB -> FP4 {out_bytes / 2**20:.0f} MiB with {args.shard_mb} MiB shards: "
          f"peak RSS above baseline {extra / 2**20:.1f} MiB "
          f"({row['checkpoint_over_peak']:.1f}x smaller than the checkpoint)")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1) + "\n")
    return row


if __name__ == "__main__":
    main()
