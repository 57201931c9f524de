"""The embedded default (`make demo`) on several seeds: does the reward rise on this machine?

    python bench/demo_seeds.py                      # seeds 0 1 2, two runs at a time, one thread each
    python bench/demo_seeds.py --seeds 3,4 --parallel 1
    python bench/demo_seeds.py --set rl.steps=60 --out /tmp/trial   # a candidate default, beside today's

Each seed runs `trace-rl train --set seed=<s>` exactly as `make demo` does (OMP_NUM_THREADS=1),
and writes bench/results/demo_seeds_<date>_cpu[-<isa>].{md,json,png}: per seed the mean reward
of the first and last 10 RL steps and the wall time; the plot shows reward per step per seed.

To run on other BF16 kernels than this CPU's best, cap the instruction set of ATen and oneDNN:

    ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 python bench/demo_seeds.py   # -> ..._cpu-avx2.*
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, runs: Path, sets: list[str]) -> dict:
    out = runs / f"seed{seed}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with (runs / f"seed{seed}.log").open("w") as log:
        subprocess.run([sys.executable, "-c", "from megatron_trace.quiet import trace_rl; trace_rl()", "train",
                        "--set", f"seed={seed}", "--set", f"output_dir={out}",
                        *(a for x in sets for a in ("--set", x))],
                       check=True, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward"] for r in rows]
    return {"seed": seed, "wall_s": time.perf_counter() - t0, "rewards": rewards,
            "first10": sum(rewards[:10]) / 10, "last10": sum(rewards[-10:]) / 10,
            "clip_frac_mean": sum(r["clip_frac"] for r in rows) / len(rows),
            "k3_kl_last": rows[-1]["k3_kl"]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(r["rewards"], label=f"seed {r['seed']}: {r['first10']:.2f} -> {r['last10']:.2f}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (mean over the step's samples)")
    ax.set_title("make demo (embedded default), per seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (one CPU thread each)")
    ap.add_argument("--runs", default="runs/demo_seeds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a `trace-rl --set` override on top of the embedded default (repeatable)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = Path(args.runs).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda s: run_seed(s, runs, args.set), seeds))
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "")
    caps = " ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA") if k in os.environ)
    date = datetime.date.today().isoformat()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = Path(args.out) / f"demo_seeds_{date}_cpu{'-' + isa if isa else ''}"
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    cpu = f"{platform.machine()}, {'/'.join(f for f in ('avx512_bf16', 'amx_bf16') if f in flags) or 'no BF16 ISA'}"
    if caps:
        cpu += f"; kernels capped by {caps}"
    meta = {"date": date, "machine": f"{os.cpu_count()} CPU cores ({cpu})", "parallel": args.parallel,
            "command": f"{caps + ' ' if caps else ''}python bench/demo_seeds.py --seeds {args.seeds} "
                       f"--parallel {args.parallel}" + "".join(f" --set {x}" for x in args.set)}
    stem.with_suffix(".json").write_text(json.dumps({**meta, "results": results}, indent=1))
    plot(results, stem.with_suffix(".png"))
    lines = [f"# `make demo` on {len(seeds)} seeds ({date}, {meta['machine']})", "",
             f"Command: `{meta['command']}` ({args.parallel} runs at a time, one thread each).", "",
             "| seed | reward, first 10 steps | last 10 steps | rise | mean clip_frac | k3_kl (last step) | wall |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['seed']} | {r['first10']:.3f} | {r['last10']:.3f} | {r['last10'] - r['first10']:+.3f} | "
                     f"{r['clip_frac_mean']:.3f} | {r['k3_kl_last']:.1e} | {r['wall_s'] / 60:.1f} min |")
    lines += ["", f"![reward per step]({stem.with_suffix('.png').name})", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
