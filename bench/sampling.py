"""Sampling a decode step's rows: `sample_rows` (the whole batch on the logits' device) against
the engine's previous sampler (each row copied to the host and drawn there with its own
torch.Generator), at a Qwen3 vocabulary.

    python bench/sampling.py [--batch 64] [--vocab 151936] [--record]

Times one step's sampling (median of --reps after a warm-up), for top-p 1 and 0.95; on a GPU
also the device time of one step's draw from BF16 logits (tokens and log-probabilities, no host
copy), the fused `sample_tempered` against the engine's `draw_rows` (unfused passes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def host_sample(logits_v: torch.Tensor, params, gen: torch.Generator) -> tuple[int, float]:
    """The engine's sampler before `sample_rows` (temperature > 0, no top-k): one row on the host."""
    logits_v = logits_v.float().cpu()
    logp = torch.log_softmax(logits_v / params.temperature, -1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p * sorted_p.sum()
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
    return token, float(logp[token])


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls after one warm-up, the device synchronised around each."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_ms(fn, reps: int = 100) -> float:
    """Mean GPU milliseconds of fn() over reps back-to-back calls (CUDA events), after a warm-up.
    The device first sleeps while the host queues every call, so host overhead between launches
    does not count."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz: longer than the host takes to queue the calls
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def sweep_split_kernel(bf16: torch.Tensor, keys: list[int]) -> list[dict]:
    """Device ms of `sample_tempered` (temperature 0.7) on bf16 [B, V] CUDA logits for a few loop
    blocks and warp counts of its split kernel (the module's constants, restored after)."""
    from trace_kernels import sampling

    default = (sampling.SPLIT_BLOCK, sampling.SPLIT_WARPS)
    keys_t, steps = torch.tensor(keys), torch.zeros(len(keys), dtype=torch.int64)
    copy_gb_s = 2 * bf16.numel() * 2 / device_ms(bf16.clone) / 1e6  # the ceiling: a copy's read + write
    out = []
    try:
        for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8)]:
            sampling.SPLIT_BLOCK, sampling.SPLIT_WARPS = block, warps
            ms = device_ms(lambda: sampling.sample_tempered(bf16, 0.7, keys_t, steps))
            out.append({"block": block, "warps": warps, "default": (block, warps) == default, "fused_ms": ms,
                        "read_gb_s": bf16.numel() * 2 / ms / 1e6, "copy_gb_s": copy_gb_s})
            print(f"split kernel block {block} warps {warps}: {ms:.3f} ms", flush=True)
    finally:
        sampling.SPLIT_BLOCK, sampling.SPLIT_WARPS = default
    return out


def main() -> None:
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine.sampler import draw_rows, sample_key, sample_rows

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    logits = torch.randn(args.batch, args.vocab, device=device, generator=torch.Generator(device).manual_seed(0)) * 2
    keys = [sample_key(0, f"s{i}") for i in range(args.batch)]
    rows = []
    for top_p in (1.0, 0.95):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        gens = [torch.Generator().manual_seed(i) for i in range(args.batch)]
        host = timed(lambda: [host_sample(logits[i], params, gens[i]) for i in range(args.batch)], args.reps)
        batched = timed(lambda: sample_rows(logits, params, keys, [0] * args.batch), args.reps)
        rows.append({"top_p": top_p, "batch": args.batch, "vocab": args.vocab, "host_rows_ms": host * 1e3,
                     "sample_rows_ms": batched * 1e3, "speedup": host / batched, "device": gpu})
        print(f"top_p {top_p}: per-row host sampling {host * 1e3:.2f} ms, sample_rows {batched * 1e3:.3f} ms "
              f"({host / batched:.0f}x)", flush=True)
    fused_rows, split_rows = [], []
    if device == "cuda":
        from trace_kernels.sampling import sample_tempered

        bf16 = logits.bfloat16()
        for temperature in (1.0, 0.7):
            # the engine's draw today: float copy, division, Gumbel argmax, log_softmax, gather
            old = device_ms(lambda: draw_rows(bf16, SamplingParams(temperature=temperature), keys, [0] * args.batch))
            new = device_ms(lambda: sample_tempered(bf16, temperature, torch.tensor(keys),
                                                    torch.zeros(args.batch, dtype=torch.int64)))
            fused_rows.append({"temperature": temperature, "unfused_ms": old, "fused_ms": new})
            print(f"temperature {temperature}: draw from bf16 logits, unfused {old:.3f} ms, fused {new:.3f} ms "
                  f"({old / new:.2f}x)", flush=True)
        split_rows = sweep_split_kernel(bf16, keys)
    if args.record:
        date = datetime.date.today().isoformat()
        stem = RESULTS / f"sampling_{date}_{gpu.split()[-1].lower()}"
        cmd = "python bench/sampling.py " + " ".join(sys.argv[1:])
        stem.with_suffix(".json").write_text(json.dumps({"date": date, "command": cmd, "rows": rows,
                                                         "draw_rows": fused_rows,
                                                         "split_kernel": split_rows}, indent=1) + "\n")
        lines = [f"# Sampling one decode step, {date}, {gpu}", "", f"`{cmd}`", "",
                 f"Batch {args.batch}, vocabulary {args.vocab}, temperature 1; median of {args.reps} steps.", "",
                 "| top-p | per-row host sampling ms | sample_rows ms | speedup |", "|---|---|---|---|"]
        lines += [f"| {r['top_p']} | {r['host_rows_ms']:.2f} | {r['sample_rows_ms']:.3f} | {r['speedup']:.0f}x |"
                  for r in rows]
        if fused_rows:
            lines += ["", "Device time of one step's draw from BF16 logits (mean of 100, no host copy):", "",
                      "| temperature | unfused ms | fused ms | unfused / fused |", "|---|---|---|---|"]
            lines += [f"| {r['temperature']} | {r['unfused_ms']:.3f} | {r['fused_ms']:.3f} | "
                      f"{r['unfused_ms'] / r['fused_ms']:.2f}x |" for r in fused_rows]
        if split_rows:
            copy = split_rows[0]["copy_gb_s"]
            lines += ["", "The fused draw (temperature 0.7) by its split kernel's loop block and warps (the default "
                      f"marked): its one read of the logits against a copy's {copy:.0f} GB/s:", "",
                      "| block | warps | fused ms | logits read GB/s |", "|---|---|---|---|"]
            lines += [f"| {r['block']} | {r['warps']}{' (default)' if r['default'] else ''} | {r['fused_ms']:.3f} | "
                      f"{r['read_gb_s']:.0f} |" for r in split_rows]
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
