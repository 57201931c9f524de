"""A disaggregated job in one test: trainer ranks (their own gloo world with Megatron's parallel
state, as `trace-rl train` sets them up under torchrun) and engine ranks, joined by a `Bridge`.

`spawn_job(trainer_fn, engine_fn, layout, engines=1, **kwargs)` runs trainer_fn(rank, bridge,
**kwargs) on the tp * pp * dp trainer ranks and engine_fn(rank, bridge, **kwargs) on the
engine ranks, and returns every rank's result (trainers first).
"""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

from megatron_trace.megatron.spawn import _free_port, run_workers, save_result, world_size


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
    save_result(result, outdir, rank)


def spawn_job(trainer_fn, engine_fn, layout: dict, engines: int = 1, **kwargs) -> list:
    """Run the job (see the module docstring); RuntimeError with every failed rank's traceback."""
    layout = dict(layout)
    trainers = world_size(layout)
    layout.pop("dp", None)
    world = trainers + engines
    return run_workers(_worker, world, (trainer_fn, engine_fn, trainers, world, (_free_port(), _free_port()), layout,
                                        kwargs))
