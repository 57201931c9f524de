"""Host time of the engine's per-step bookkeeping at long contexts (no GPU needed).

Each decode step the engine's host asks every running sequence for its response length (to seed
the sampler, and to stop it at max_new_tokens), fills the decode graph's inputs and stores the
routed experts. Sequences built as decode builds them (one token appended to each of the batch's
sequences per step, so their int objects interleave in memory) at several lengths; per step:

- `len(seq.response)` twice per sequence: what the engine did until 2026-12-07 (a slice: a copy
  of the token list, and a reference count touched per token);
- `seq.num_response` twice per sequence: what it does now;
- `StepInputs.fill` (the decode graph's host inputs) and `RowStore.write` of the routed experts,
  for scale.

    python bench/engine_host_step.py [--batch 64] [--lengths 2048,4608,8704] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import timeit
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT, BLOCK, LAYERS, TOP_K, VOCAB = 512, 16, 12, 8, 151936


def grown_sequences(batch: int, length: int):
    """`batch` running Sequences of `length` tokens (a 512-token prompt), grown one token per
    sequence per step, as decode grows them."""
    from sglang_rollout.engine.sequence import Sequence, Status

    rng = random.Random(0)
    seqs = [Sequence(seq_id=f"s{i}", group_id="g", tokens=[rng.randrange(VOCAB) for _ in range(PROMPT)],
                     prompt_len=PROMPT, status=Status.RUNNING) for i in range(batch)]
    for _ in range(length - PROMPT):
        for seq in seqs:
            seq.tokens.append(rng.randrange(VOCAB))
    for seq in seqs:
        seq.block_table = list(range(-(-length // BLOCK)))
    return seqs


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def per_step_ms(fn, seconds: float = 0.5) -> float:
    """Median over 5 rounds of fn's time, in ms."""
    n = max(1, int(seconds / max(timeit.timeit(fn, number=1), 1e-6)))
    return sorted(timeit.repeat(fn, number=n, repeat=5))[2] / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", default="2048,4608,8704")
    ap.add_argument("--record", action="store_true", help="write bench/results/engine_host_step_<date>_cpu.md")
    args = ap.parse_args()

    from sglang_rollout.engine.cuda_graphs import StepInputs
    from sglang_rollout.engine.model import Segment
    from sglang_rollout.engine.row_store import RowStore

    rows = []
    for length in [int(v) for v in args.lengths.split(",")]:
        seqs = grown_sequences(args.batch, length)
        slicing = per_step_ms(lambda: [len(s.response) for s in seqs] + [len(s.response) for s in seqs])
        counting = per_step_ms(lambda: [s.num_response for s in seqs] + [s.num_response for s in seqs])
        inputs = StepInputs(args.batch, -(-(length + 1) // BLOCK), 0, BLOCK, pin=False)
        segments = [Segment([0], length - 1, s.block_table) for s in seqs]
        fill = per_step_ms(lambda: inputs.fill(segments))
        store = RowStore(length + 1, lambda key: 1, slots=args.batch)
        routed = torch.zeros(args.batch, LAYERS, TOP_K, dtype=torch.uint8)

        def write():
            for s in seqs:
                s.rows_stored = 0
            store.write({"experts": routed}, [(s, 1) for s in seqs])
        write()  # the buffers are allocated at the first write
        rows.append((length, slicing, counting, fill, per_step_ms(write)))
        print(f"length {length:5d}: len(response) x2 {slicing:7.3f} ms, num_response x2 {counting:6.3f} ms, "
              f"StepInputs.fill {fill:6.3f} ms, RowStore.write {rows[-1][4]:6.3f} ms", flush=True)
    if args.record:
        date = datetime.date.today().isoformat()
        lines = [f"# Engine host bookkeeping per decode step, {date}, {cpu_name()} ({os.cpu_count()} cores)",
                 "", f"`python bench/engine_host_step.py {' '.join(sys.argv[1:])}` (batch {args.batch}; "
                 "median of 5 rounds; module docstring: what each column is)", "",
                 "| tokens per sequence | `len(seq.response)` x2 (until 2026-12-07) ms | `seq.num_response` x2 ms "
                 "| `StepInputs.fill` ms | `RowStore.write` (experts) ms |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {a:.3f} | {b:.3f} | {c:.3f} | {d:.3f} |" for n, a, b, c, d in rows]
        out = ROOT / "bench" / "results" / f"engine_host_step_{date}_cpu.md"
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
