"""Training step time with Megatron's DDP + distributed optimizer (the trainer's optimizer now)
against the optimizer it replaced (FP32 master copies + torch AdamW, replicated, gradients in
the parameters' .grad), and with `optim.cpu_offload` (Megatron's HybridDeviceOptimizer: FP32
masters, gradients' copies and moments on the host, the step on the CPU), on one device, same
model, same batch.

A step is zero_grad, forward + backward of one packed micro-batch (`--precision`, default
fp4-rne: QAT's weight and activation quantization), and the optimizer step (clipping off for
both, so that they do the same arithmetic). Reports the median step time, the optimizer step
alone, peak memory, and the optimizer state bytes per rank measured from the live tensors.

    python bench/optimizer_step.py                                         # tiny model on the CPU
    python bench/optimizer_step.py --model qwen3-30b-a3b --layers 4 --tokens 16384 --record   # a GPU
    python bench/optimizer_step.py --optimizers megatron-distributed,megatron-offload ...
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from train_step import RESULTS, _init, packed_batch, shape_parser  # noqa: E402 - the benchmarks' own setup

from tests.support.master_adamw import MasterAdamW  # noqa: E402 - the replaced optimizer, the baseline


def main() -> None:
    ap = shape_parser(__doc__)
    ap.add_argument("--precision", default="fp4-rne")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--optimizers", default="master-adamw,megatron-distributed",
                    help="comma-separated, the first the baseline: master-adamw, megatron-distributed, "
                         "megatron-offload")
    args = ap.parse_args()
    names = args.optimizers.split(",")
    unknown = set(names) - {"master-adamw", "megatron-distributed", "megatron-offload"}
    if unknown:
        ap.error(f"--optimizers: unknown {sorted(unknown)}")
    if len(names) > 1:  # each optimizer in a process of its own: nothing of one stays in the next's memory
        rows = []
        for name in names:
            argv = [a for a in sys.argv[1:] if a != "--record"]
            i = argv.index("--optimizers") if "--optimizers" in argv else None
            if i is not None:
                del argv[i:i + 2]
            proc = subprocess.run([sys.executable, __file__, *argv, "--optimizers", name], capture_output=True,
                                  text=True)
            if proc.returncode:
                sys.exit(f"{name}: failed\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row | {"step_s_ms": row["step_s"] * 1e3, "optimizer_step_s_ms": row["optimizer_step_s"] * 1e3,
                               "peak": row["peak_gib"] or 0})
            print(ROW.format(**rows[-1]), flush=True)
        return report(rows, names, args)
    _init()
    from megatron.core.distributed import finalize_model_grads

    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.model import build_model, set_precision
    from megatron_trace.megatron.optimizer import TrainerOptimizer
    from megatron_trace.model_config import PRESETS

    cfg = PRESETS[args.model].replace(num_layers=args.layers)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    ids, pos, psp, labels = packed_batch(cfg, args.tokens, args.seq_len, dev)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for name in names:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = build_model(cfg, "bf16", grouped_gemm=True)
        set_precision(model, args.precision)
        if name == "master-adamw":
            opt = MasterAdamW(model, 1e-6)
            zero, finish, step, state = opt.zero_grad, (lambda: None), opt.step, opt.state_bytes
        else:
            opt = TrainerOptimizer(model, 1e-6, OptimSection(clip_grad=0.0, distributed=True,
                                                             cpu_offload=name == "megatron-offload"))
            zero, step, state = opt.zero_grad, opt.step, opt.local_state_bytes
            finish = lambda o=opt: finalize_model_grads([o.ddp])  # noqa: E731 - what the schedule calls
        fwd = opt.ddp if name != "master-adamw" else model
        steps, opt_s = [], []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            zero()
            loss = fwd(ids, pos, None, labels=labels, packed_seq_params=psp).float().mean()
            loss.backward()
            finish()
            sync()
            t1 = time.perf_counter()
            step()
            sync()
            t2 = time.perf_counter()
            if i >= args.warmup:
                steps.append(t2 - t0)
                opt_s.append(t2 - t1)
        host = psutil.Process().memory_info().rss / 2**30
        row = {"optimizer": name, "step_s": statistics.median(steps), "optimizer_step_s": statistics.median(opt_s),
               "host_rss_gib": host,
               "state_gib": state() / 2**30, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "params": sum(p.numel() for p in model.parameters()), "gpu": gpu,
               "date": datetime.date.today().isoformat(), "model": args.model, "layers": args.layers,
               "tokens": args.tokens, "precision": args.precision}
        print(json.dumps(row))


ROW = ("{optimizer:22s} step {step_s_ms:9.1f} ms  optimizer {optimizer_step_s_ms:8.1f} ms  state {state_gib:.2f} GiB  "
       "peak {peak:.1f} GiB  host RSS {host_rss_gib:.1f} GiB")


def report(rows: list[dict], names: list[str], args) -> None:
    """The ratios to the first optimizer, and with --record the results files."""
    base, gpu = rows[0], rows[0]["gpu"]
    ratios = [f"{r['optimizer']} / {base['optimizer']}: step time {r['step_s'] / base['step_s']:.3f}, "
              f"peak device memory {(r['peak_gib'] or 0) / (base['peak_gib'] or 1):.3f}" for r in rows[1:]]
    print("\n".join(ratios))
    if args.record:
        tag = "" if names == ["master-adamw", "megatron-distributed"] else "_" + "_vs_".join(names[1:] + names[:1])
        stem = RESULTS / (f"optimizer_step{tag}_{rows[0]['date']}_{args.layers}l_"
                          f"{'h200' if 'H200' in gpu else gpu.replace(' ', '_')}")
        stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        cmd = "python bench/optimizer_step.py " + " ".join(sys.argv[1:])
        lines = [f"# Training step: {', '.join(names[1:])} against {names[0]}, {rows[0]['date']}, {gpu}", "",
                 f"`{cmd}`", "",
                 f"{args.model} at full width, {args.layers} layers ({rows[0]['params'] / 1e9:.2f} B parameters), "
                 f"one micro-batch of {args.tokens} tokens, {args.precision}; one device (data-parallel size 1, "
                 "so the distributed optimizer shards nothing here: per-rank state is 1/DP of this); each "
                 "optimizer measured in a process of its own.", "",
                 "| optimizer | step (ms) | optimizer step (ms) | optimizer state (GiB) | peak device (GiB) | "
                 "host RSS (GiB) |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['optimizer']} | {r['step_s'] * 1e3:.1f} | {r['optimizer_step_s'] * 1e3:.1f} | "
                  f"{r['state_gib']:.2f} | {r['peak_gib'] or 0:.1f} | {r['host_rss_gib']:.1f} |" for r in rows]
        lines += ["", *[f"- {r}" for r in ratios], ""]
        stem.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
