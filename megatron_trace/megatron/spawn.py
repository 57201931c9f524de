"""Run a function on N processes with a real process group and Megatron's parallel state:
gloo on the CPU (with the CPU patches), NCCL with one GPU per rank where CUDA is present.

`spawn(fn, layout, **kwargs)` starts one process per rank (torch.multiprocessing, spawn), sets
up gloo and `initialize_model_parallel_cpu(**layout)`, calls `fn(rank, **kwargs)` and returns
the per-rank results (anything torch.save can write).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world, port, layout, kwargs, outdir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if torch.cuda.is_available():  # NCCL, one GPU per rank; the CPU patches stay off
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_trace.megatron.cpu_patches import (
        destroy_model_parallel_cpu,
        initialize_model_parallel_cpu,
    )

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        initialize_model_parallel_cpu(**layout)
        result = {"ok": fn(rank, **kwargs)}
    except Exception:  # noqa: BLE001 - reported to the parent, which raises
        result = {"error": traceback.format_exc()}
    save_result(result, outdir, rank)
    try:
        destroy_model_parallel_cpu()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best-effort teardown; the result is already saved
        pass


def world_size(layout: dict) -> int:
    return layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


def spawn(fn, layout: dict, **kwargs) -> list:
    """Run fn(rank, **kwargs) on tp * pp * dp ranks of the Megatron `layout` (tp, pp, ep, etp, dp)."""
    layout = dict(layout)
    world = world_size(layout)
    layout.pop("dp", None)
    return run_workers(_worker, world, (fn, world, _free_port(), layout, kwargs))


def save_result(result: dict, outdir: str, rank: int) -> None:
    """A rank's {"ok": ...} or {"error": ...} to outdir/<rank>.pt, written atomically: the parent
    reads a rank's file as its final word even when the process dies afterwards."""
    path = os.path.join(outdir, f"{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)


def run_workers(worker, world: int, args: tuple, grace_s: float = 60.0) -> list:
    """worker(rank, *args, outdir) on `world` spawned processes, each saving {"ok": result} or
    {"error": traceback} with `save_result`; the results in rank order, RuntimeError with every
    failing rank's traceback.

    A rank that saved its result and then died in teardown (a signal from a library's exit
    handlers, seen with gloo and DeepSpeed's threads) still counts as finished. Once a rank has
    failed (an error saved, or an exit without a result), the others get `grace_s` seconds to
    finish before they are killed: they may be waiting in a collective the failed rank left."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(worker, args=(*args, outdir), nprocs=world, start_method="spawn", join=False)
        procs, results, exits = ctx.processes, [None] * world, [None] * world
        failed_at = None
        while any(e is None for e in exits):
            live = [p.sentinel for p, e in zip(procs, exits, strict=True) if e is None]
            timeout = None if failed_at is None else max(0.0, failed_at + grace_s - time.monotonic())
            multiprocessing.connection.wait(live, timeout)
            for r, p in enumerate(procs):
                if exits[r] is None and p.exitcode is not None:
                    exits[r] = p.exitcode
                    path = os.path.join(outdir, f"{r}.pt")
                    if os.path.exists(path):
                        results[r] = torch.load(path, weights_only=False)
                    if (results[r] is None or "error" in results[r]) and failed_at is None:
                        failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() >= failed_at + grace_s:
                for r, p in enumerate(procs):
                    if exits[r] is None:
                        p.kill()
                        p.join()
                        exits[r] = "killed"
    errors = []
    for r, (res, code) in enumerate(zip(results, exits, strict=True)):
        if res is None:
            why = f"exit code {code}" if code != "killed" else f"killed {grace_s:.0f} s after another rank failed"
            errors.append(f"rank {r}: no result ({why})")
        elif "error" in res:
            errors.append(f"rank {r}:\n{res['error']}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return [res["ok"] for res in results]


def init_one_process() -> None:
    """torch.distributed with one rank (gloo, or NCCL on a GPU) and Megatron's parallel state."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .cpu_patches import initialize_model_parallel_cpu

    if not dist.is_initialized():
        port = _free_port()
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    initialize_model_parallel_cpu()  # patches only without CUDA
