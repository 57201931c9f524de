"""`trace-rl plan` against a measured run: the peak memory of one colocated RL step on the CPU.

Builds the run a config describes (default: the `small` preset, 28 M parameters, no warm-up,
two RL steps in trace mode, so the second runs with AdamW's moments allocated), runs it in this
process and compares the peak resident memory above the post-import baseline (Linux VmHWM -
VmRSS before the run) with the plan's trainer peak plus the colocated engine. oneDNN is turned
off: its primitive cache keeps reordered weight copies for every new matmul shape (+300 MiB of
RSS over three steps here), a CPU-only effect the GPU plan has no counterpart for.

    python bench/plan_memory.py [--set section.key=value ...] [--out bench/results/NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(overrides: list[str]) -> dict:
    """{"plan": plan_json, "measured_bytes", "planned_bytes", "ratio"} for the run."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the engine's Triton kernels, interpreted on the CPU

    torch.backends.mkldnn.enabled = False
    from megatron_trace.checkpoint.safetensors_io import release_large_frees

    release_large_frees()  # freed tensors go back to the OS, so RSS follows live tensors as a GPU allocator's peak does
    from megatron_trace.backend import backend_options, engine_factory
    from megatron_trace.config import load_config
    from megatron_trace.megatron.spawn import init_one_process
    from megatron_trace.rl import train as train_module
    from megatron_trace.rl.factories import resolve_model_config
    from megatron_trace.rl.plan import (
        architecture,
        engine_kv_blocks,
        make_plan,
        plan_json,
    )

    with tempfile.TemporaryDirectory() as out:
        # one update per rollout: the plan sizes activations for all of a rank's samples at once
        cfg = load_config(None, ["model.preset=small", "sft.steps=0", "rl.steps=2", "checkpoint.every=0",
                                 "rl.mini_batches=1", f"output_dir={out}", *overrides])
        init_one_process()
        model_cfg = resolve_model_config(cfg.model)
        plan = make_plan(cfg, architecture(cfg))
        make_engine = engine_factory(cfg.rollout.backend, model_cfg, cfg.model.preset, engine_kv_blocks(cfg),
                                     **backend_options(cfg))
        cuda = torch.cuda.is_available()

        def peak_bytes():  # on a GPU the caching allocator's peak, else the process's peak RSS
            return torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024

        save, peaks = train_module.save_checkpoint, []

        def save_after_peak(*args, **kwargs):  # the write stages tensors in host memory: not the GPU plan's
            peaks.append(peak_bytes())
            return save(*args, **kwargs)
        train_module.save_checkpoint = save_after_peak
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else _status_kib("VmRSS") * 1024
        try:
            train_module.train(cfg, make_engine, model_cfg, progress=False)
        finally:
            train_module.save_checkpoint = save
        with_checkpoint = peak_bytes()
    measured = max(peaks) - base
    planned = plan.trainer_peak + plan.engine_total
    return {"plan": plan_json(plan), "measured_bytes": measured, "planned_bytes": planned, "ratio": planned / measured,
            "measured_with_checkpoint_write_bytes": with_checkpoint - base,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default=None, help="write NAME.json and NAME.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    r = measure(args.set)
    mib = 2**20
    print(f"planned {r['planned_bytes'] / mib:.1f} MiB, measured {r['measured_bytes'] / mib:.1f} MiB "
          f"(planned / measured {r['ratio']:.3f}); with the checkpoint write "
          f"{r['measured_with_checkpoint_write_bytes'] / mib:.1f} MiB; {time.perf_counter() - t0:.0f} s")
    if args.out:
        machine = r["device"] if r["device"] != "cpu" else f"{platform.machine()} CPU, {os.cpu_count()} cores"
        r |= {"date": time.strftime("%Y-%m-%d"), "machine": machine,
              "command": "python bench/plan_memory.py " + " ".join(f"--set {s}" for s in args.set)}
        Path(args.out + ".json").write_text(json.dumps(r, indent=1) + "\n")
        rows = "\n".join(f"| {k} | {v / mib:.2f} |" for k, v in {**r["plan"]["trainer_bytes"],
                                                               **r["plan"]["engine_bytes"]}.items())
        Path(args.out + ".md").write_text(
            f"# trace-rl plan vs a measured run, {r['date']}, {r['machine']}\n\n    {r['command']}\n\n"
            f"| item (MiB) | planned |\n|---|---|\n{rows}\n\n"
            f"Planned peak (trainer peak + colocated engine): {r['planned_bytes'] / mib:.1f} MiB; measured peak "
            f"({'torch.cuda.max_memory_allocated' if r['device'] != 'cpu' else 'RSS'}) above the baseline: "
            f"{r['measured_bytes'] / mib:.1f} MiB; planned / measured "
            f"{r['ratio']:.3f}. Writing the end-of-run checkpoint (host memory on a GPU) raises the measured peak to "
            f"{r['measured_with_checkpoint_write_bytes'] / mib:.1f} MiB.\n")


if __name__ == "__main__":
    main()
