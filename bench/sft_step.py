"""Time of one SFT step (`trace-rl sft`'s: Megatron DDP + optimizer, packed short sequences) on
the chain task, with the trainer's packed attention as it is (RoPE over the whole pack, one
attention call per distinct sequence length) and as it was (Megatron's THD RoPE and one
attention call per sequence), and where the rest of the step goes.

    python bench/sft_step.py --preset moe-0.4b --batch 128 --steps 5      # on a GPU
    python bench/sft_step.py --preset demo --batch 16 --steps 2           # CPU

Prints the median step per attention variant, then the profiler's top operators of one step
(self CPU time and device time). --record writes bench/results/sft_step_<date>_<device>.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def per_sequence_attention(self, query, key, value, cu):
    """The replaced THD path: one attention call per packed sequence (the baseline)."""
    outs = []
    for lo, hi in pairwise(cu):
        q, k, v = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))
    pad = query.shape[0] - cu[-1]
    if pad:
        outs.append(query.new_zeros(pad, *query.shape[1:]))
    return torch.cat(outs).reshape(query.shape[0], -1)


def per_sequence_rope(self, query, key, cu):
    """The replaced RoPE: Megatron's THD path (one sequence at a time), as before."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    freqs = self.rope(max(hi - lo for lo, hi in pairwise(cu)))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=query.device)
    return (apply_rotary_pos_emb(t, freqs, self.config, cu_seqlens=cu_t,
                                 cp_group=parallel_state.get_context_parallel_group()) for t in (query, key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--terms", type=int, default=4)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    from megatron_trace.megatron.spawn import init_one_process

    init_one_process()
    from megatron_trace.megatron import attention
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import MegatronTrainer
    from megatron_trace.model_config import PRESETS
    from megatron_trace.rl.sft import sft_step
    from megatron_trace.rl.tasks import ChainTask

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    cfg = PRESETS[args.preset]
    model = build_model(cfg, "bf16", grouped_gemm=True)
    trainer = MegatronTrainer(model, cfg)
    trainer.start_phase(1e-5)
    task = ChainTask(args.digits, "+-", args.terms, seed=0)
    batches = [[task.sft_example(p) for p in task.problems(args.batch)] for _ in range(4)]
    tokens = sum(len(t) for t, _ in batches[0])

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(n):
        times = []
        for i in range(args.warmup + n):
            sync()
            t0 = time.perf_counter()
            sft_step(trainer, batches[i % len(batches)])
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    cls = attention.FP4CoreAttention
    now = (cls._packed, cls._rotate)
    rows = []
    for name, (packed, rotate) in (("whole pack (now)", now),
                                   ("per sequence (before)", (per_sequence_attention, per_sequence_rope))):
        cls._packed, cls._rotate = packed, rotate
        t = timed(args.steps)
        rows.append((name, t))
        print(f"{name:24s} step {t * 1e3:8.1f} ms  {tokens / t:9.0f} tokens/s", flush=True)
    cls._packed, cls._rotate = now
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        sft_step(trainer, batches[0])
        sync()
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50)
    table_dev = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50) \
        if cuda else ""
    print(table_cpu)
    print(table_dev)
    if args.record:
        date = datetime.date.today().isoformat()
        tag = "h200" if "H200" in device else "gpu" if cuda else "cpu"
        out = ROOT / "bench" / "results" / f"sft_step_{date}_{tag}.md"
        lines = [f"# SFT step, {date}, {device}", "", f"`python bench/sft_step.py {' '.join(sys.argv[1:])}`", "",
                 f"{args.preset}, chain task ({args.terms} x {args.digits} digits), {args.batch} sequences "
                 f"({tokens} tokens) per step, Megatron DDP + distributed optimizer, BF16.", "",
                 "| RoPE and attention over the pack | step (ms) | tokens/s |", "|---|---|---|"]
        lines += [f"| {n} | {t * 1e3:.1f} | {tokens / t:.0f} |" for n, t in rows]
        lines += ["", f"Speed-up: {rows[1][1] / rows[0][1]:.2f}x", "", "Top operators of one step (now):", "",
                  "```", table_cpu, table_dev, "```"]
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
