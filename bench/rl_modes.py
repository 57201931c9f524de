"""The embedded default's RL phase in each run mode, from one shared SFT warm-up.

    python bench/rl_modes.py                     # 40 RL steps per mode, ~10 min on 2 CPU cores
    python bench/rl_modes.py --steps 10 --modes bf16,trace

Runs `trace-rl sft` once, then `trace-rl train` per mode starting from the warmed-up model
(model.megatron=<sft run>/checkpoints/rl-000000/model), and writes
bench/results/rl_modes_<date>_cpu.{md,json,png}: reward and k3_kl per step per mode, flip
rates by layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_trace.rl.report import plot_report

ROOT = Path(__file__).resolve().parents[1]


def trace_rl(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "megatron_trace.cli", *args], check=True, env=env, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="bf16,fp4-rollout,fp4-qat,trace")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", default="runs/rl_modes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    runs = Path(args.runs)
    trace_rl("sft", "--set", f"output_dir={runs / 'sft'}")
    start = runs / "sft" / "checkpoints" / "rl-000000" / "model"
    results = {}
    for mode in args.modes.split(","):
        trace_rl("train", "--set", "sft.steps=0", "--set", f"model.megatron={start}", "--set", f"rl.steps={args.steps}",
                 "--set", f"rl.mode={mode}", "--set", "checkpoint.resume=false", "--set",
                 f"output_dir={runs / mode}")
        results[mode] = [json.loads(line) for line in (runs / mode / "metrics.jsonl").read_text().splitlines()]
    date = datetime.date.today().isoformat()
    stem = Path(args.out) / f"rl_modes_{date}_cpu"
    plot_report(results, stem.with_suffix(".png"), f"embedded default, {args.steps} GRPO steps per mode (CPU)")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    k = max(1, args.steps // 4)
    lines = [f"# RL on the embedded default per run mode — {date}, CPU ({os.cpu_count()} cores)", "",
             f"`python bench/rl_modes.py --steps {args.steps} --modes {args.modes}`: one SFT warm-up (1000 steps), "
             f"then {args.steps} GRPO steps per mode from it (same prompts and sampling seeds).", "",
             f"| mode | reward, first {k} steps | reward, last {k} steps | mean k3_kl | mean flip rate | "
             "mean residual flip rate |", "|---|---|---|---|---|---|"]
    for mode, rows in results.items():
        def mean(key, rows=rows):
            vals = [r[key] for r in rows if key in r]
            return f"{sum(vals) / len(vals):.3g}" if vals else "-"
        first = sum(r["reward"] for r in rows[:k]) / k
        last = sum(r["reward"] for r in rows[-k:]) / k
        lines.append(f"| {mode} | {first:.3f} | {last:.3f} | {mean('k3_kl')} | {mean('flip_rate')} | "
                     f"{mean('residual_flip_rate')} |")
    lines += ["", f"Plot: `{stem.name}.png`; every step's metrics: `{stem.name}.json`."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
