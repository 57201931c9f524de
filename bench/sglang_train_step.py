"""`trace-rl train` colocated on one GPU with the built-in engine and with SGLang: the same run,
each RL step split into rollout / train / sync seconds (metrics.jsonl), side by side.

    bash .sglrun/run.sh bench/sglang_train_step.py --model demo --out $OUT/train_step_demo.json
    bash .sglrun/run.sh bench/sglang_train_step.py --model qwen3-30b-a3b --layers 4 --steps 4 ...

Each backend's run is a process of its own (trace-rl train, --set rollout.backend=...), started
from the same seed and settings (trace mode, guidance on every layer): `--model` is a preset,
`--layers` cuts it to its first layers (random initialisation, `--sft-steps` of warm-up). The
first RL step is reported but left out of the medians (CUDA graphs, Triton compilation,
SGLang's first batches). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ("rollout_s", "train_s", "sync_s", "step_s")


def child(preset: str, layers: int, argv: list[str]) -> None:
    """`trace-rl train argv` with PRESETS[preset] cut to `layers` layers under the name preset-<layers>l."""
    sys.path.insert(0, str(ROOT))
    from megatron_trace.model_config import PRESETS
    from megatron_trace.quiet import trace_rl

    name = preset
    if layers:
        name = f"{preset}-{layers}l"
        PRESETS[name] = PRESETS[preset].replace(num_layers=layers)
    sys.argv = ["trace-rl", "train", "--set", f"model.preset={name}", *argv]
    trace_rl()


def run(backend: str, args, out_dir: Path) -> dict:
    train = ["--set", f"rollout.backend={backend}", "--set", f"output_dir={out_dir}", "--set", f"rl.steps={args.steps}",
             "--set", f"sft.steps={args.sft_steps}", "--set", "rl.mode=trace", "--set", "rl.guide=all",
             *sum((["--set", s] for s in args.set), [])]
    cmd = [sys.executable, __file__, "--child", args.model, str(args.layers), *train]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    metrics = out_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    # the run's checkpoints go: at 30B-A3B shape one is ~41 GiB (FP32 optimizer state), two fill the disk
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    if proc.returncode:  # keep the steps that finished (a failure after them must not lose the split)
        return {"backend": backend, "ok": False, "wall_s": wall, "error": proc.stderr[-3000:], "steps": rows}
    later = rows[1:] or rows
    return {"backend": backend, "ok": True, "wall_s": wall, "steps": rows,
            "median": {k: statistics.median(r[k] for r in later) for k in SPLIT},
            "first_step": {k: rows[0][k] for k in SPLIT},
            "k3_kl": max(r.get("k3_kl", 0.0) for r in rows), "response_tokens": statistics.median(
                r["response_tokens"] for r in later)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--layers", type=int, default=0, help="the preset's first layers only (0: all)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--backends", default="builtin,sglang")
    ap.add_argument("--set", action="append", default=[], help="more trace-rl settings, section.key=value")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    work = Path(tempfile.mkdtemp())
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "model": args.model, "layers": args.layers, "steps": args.steps, "set": args.set,
              "runs": []}
    for b in args.backends.split(","):  # written after each backend: a run cut short keeps the earlier ones
        result["runs"].append(run(b, args, work / b))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.model} ({args.layers or 'all'} layers), {args.steps} RL steps, {result['gpu']}; "
          "medians of steps 2.. (first step)")
    print(f"{'backend':10s} " + " ".join(f"{k:>16s}" for k in SPLIT) + "   k3_kl   tokens")
    for r in result["runs"]:
        if not r["ok"]:
            print(f"{r['backend']:10s} FAILED: {r['error'][-1500:]}")
            continue
        cells = " ".join(f"{r['median'][k]:7.2f} ({r['first_step'][k]:6.1f})" for k in SPLIT)
        print(f"{r['backend']:10s} {cells}  {r['k3_kl']:.1e}  {r['response_tokens']:.0f}")


if __name__ == "__main__":
    main()
