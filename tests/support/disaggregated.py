"""A disaggregated job in one test: trainer ranks (their own gloo world with Megatron's parallel
state, as `trace-rl train` sets them up under torchrun) and engine ranks, joined by a `Bridge`.

`spawn_job(trainer_fn, engine_fn, layout, engines=1, **kwargs)` runs trainer_fn(rank, bridge,
**kwargs) on the tp * pp * dp trainer ranks and engine_fn(rank, bridge, **kwargs) on the
engine ranks, and returns every rank's result (trainers first).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_trace.megatron.spawn import _free_port, world_size


def _worker(rank, trainer_fn, engine_fn, trainers, world, ports, layout, kwargs, outdir):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    from megatron_trace.megatron.cpu_patches import initialize_model_parallel_cpu
    from megatron_trace.rl.bridge import Bridge, Roles

    try:
        store = dist.TCPStore("127.0.0.1", ports[0], world, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=120))
        bridge = Bridge(store, Roles(rank, world, trainers), "gloo", timeout_s=120)
        if rank < trainers:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                                    world_size=trainers)
            initialize_model_parallel_cpu(**layout)
            result = {"ok": trainer_fn(rank, bridge, **kwargs)}
        else:
            result = {"ok": engine_fn(rank, bridge, **kwargs)}
    except Exception:  # noqa: BLE001 - reported to the parent, which raises
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))


def spawn_job(trainer_fn, engine_fn, layout: dict, engines: int = 1, **kwargs) -> list:
    """Run the job (see the module docstring); RuntimeError with every failed rank's traceback."""
    layout = dict(layout)
    trainers = world_size(layout)
    layout.pop("dp", None)
    world = trainers + engines
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(trainer_fn, engine_fn, trainers, world, (_free_port(), _free_port()), layout,
                                          kwargs, outdir), nprocs=world, start_method="spawn", join=True)
        results = [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [res["ok"] for res in results]
