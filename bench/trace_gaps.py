"""Where a step's GPU waits: idle gaps between kernels in a Chrome trace of torch's profiler
(bench/train_step.py --trace), each laid to the code that launched the kernel after it.

A gap whose next kernel was launched after the gap began is host-bound: the host was late, and
the innermost TRACE or Megatron frame around that launch names the code it was running. A gap
whose kernel was launched before it began waited for something else (a copy, an event, the
order of streams). Given two traces (a baseline first), the idle time of each frame is set side by
side, largest difference first.

    python bench/trace_gaps.py trace/train_step_local_fp4-rne.json.gz trace/train_step_local_fp4-guided.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROJECT = ("megatron_trace/", "trace_kernels/", "kernels/fp4/", "kernels/")
MEGATRON = ("megatron/core/",)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass
class Gaps:
    """A trace's GPU timeline: span and busy time (us), idle microseconds per launching frame,
    and host time per CUDA runtime call (count, us)."""

    span_us: float
    busy_us: float
    idle_by_frame: collections.Counter
    runtime: dict[str, tuple[int, float]]


def _frames(events: list[dict]):
    """Python frames as arrays (start, end, name), innermost last among those enclosing a time."""
    py = [e for e in events if e.get("cat") == "python_function" and "dur" in e]
    start = np.array([e["ts"] for e in py], dtype=np.float64)
    end = start + np.array([e["dur"] for e in py], dtype=np.float64)
    return start, end, [e["name"] for e in py]


def _frame_at(t: float, frames) -> str:
    """The innermost project frame (else Megatron frame) running at host time t, or '?'."""
    start, end, names = frames
    idx = np.nonzero((start <= t) & (end >= t))[0]
    if not len(idx):
        return "?"
    idx = idx[np.argsort(start[idx])]  # outermost first: a callee starts after its caller
    for marks in (PROJECT, MEGATRON):
        inner = [names[i] for i in idx if any(m in names[i] for m in marks)]
        if inner:
            return _short(inner[-1])
    return _short(names[idx[-1]])


def _short(name: str) -> str:
    """'/a/b/megatron_trace/megatron/qat.py(172): quantize_input' -> 'megatron/qat.py(172): quantize_input'."""
    path, _, rest = name.partition("(")
    return "/".join(path.split("/")[-2:]) + ("(" + rest if rest else "")


def gaps(path: Path, min_gap_us: float = 20.0) -> Gaps:
    """Read one gzipped (or plain) Chrome trace and lay its GPU idle gaps of at least min_gap_us."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        raise SystemExit(f"{path}: no GPU kernels in this trace (a CPU run's trace has none)")
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    runtime = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e["dur"]
    frames = _frames(events)
    idle = collections.Counter()
    busy, end = 0.0, gpu[0]["ts"]
    for e in gpu:
        gap = e["ts"] - end
        if gap >= min_gap_us:
            issued = launch.get(e["args"].get("correlation"))
            if issued is None:
                where = "launch not traced"
            elif issued > end:
                where = _frame_at(issued, frames)
            else:
                where = f"waited, launched early: {e['name'][:60]}"
            idle[where] += gap
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    return Gaps(end - gpu[0]["ts"], busy, idle, {k: (n, t) for k, (n, t) in runtime.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path, help="one trace, or a baseline and a trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    runs = [gaps(p, args.min_gap_us) for p in args.traces]
    for p, g in zip(args.traces, runs, strict=True):
        print(f"{p.name}: GPU span {g.span_us / 1e3:.1f} ms, busy {g.busy_us / 1e3:.1f} ms, idle "
              f"{(g.span_us - g.busy_us) / 1e3:.1f} ms ({sum(g.idle_by_frame.values()) / 1e3:.1f} ms in gaps "
              f">= {args.min_gap_us:.0f} us)")
        heavy = sorted(g.runtime.items(), key=lambda kv: -kv[1][1])[:8]
        print("  host in CUDA runtime: " + ", ".join(f"{k} {n}x {t / 1e3:.1f} ms" for k, (n, t) in heavy))
    frames = set().union(*(g.idle_by_frame for g in runs))
    if len(runs) == 1:
        rows = sorted(frames, key=lambda f: -runs[0].idle_by_frame[f])
        print("idle ms  launching frame")
        for f in rows[: args.top]:
            print(f"{runs[0].idle_by_frame[f] / 1e3:7.2f}  {f}")
        return
    base, new = runs[0].idle_by_frame, runs[-1].idle_by_frame
    print(f"idle ms: {args.traces[0].name} / {args.traces[-1].name} / difference, launching frame")
    for f in sorted(frames, key=lambda f: -(new[f] - base[f]))[: args.top]:
        print(f"{base[f] / 1e3:7.2f} {new[f] / 1e3:7.2f} {(new[f] - base[f]) / 1e3:+7.2f}  {f}")


if __name__ == "__main__":
    main()
