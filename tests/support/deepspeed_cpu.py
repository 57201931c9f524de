"""DeepSpeed (pinned: 0.19.8) on the CPU over gloo, for tests only: no GPU path imports this.

`spawn(fn, world=2, **kwargs)` runs fn(rank, **kwargs) on `world` processes, each with DeepSpeed's
communication backend up (`init_distributed`), and returns the per-rank results (anything
torch.save can write). In those processes `initialize(model, ds_config)` is
`deepspeed.initialize` with torch's AdamW, and `gathered_weights(model)` the full weights under
any ZeRO stage.

Why each shim exists (measured: docs/notes/scale-trainer-deepspeed-te.md, "DeepSpeed 0.19.8
on the CPU"):
- DS_ACCELERATOR=cpu: DeepSpeed picks the CPU accelerator by itself without CUDA, but a GPU
  machine running the CPU suite would get CUDA + NCCL; gloo is asked for by name (the CPU
  accelerator's own choice only when oneCCL is absent).
- `build_shm_op -> None`: every cold `init_distributed` JIT-compiles the shm_comm op (about 3 min
  on 2 cores) that training does not need. It is patched through sys.modules: after
  `import deepspeed.comm.torch` the attribute `deepspeed.comm.torch` is torch itself (re-exported
  by `deepspeed.comm`), so patching it would miss DeepSpeed's module.
- `OpBuilder.jit_load` raises: any other op compile (FusedAdam, DeepSpeedCPUAdam: 3-4 min each
  on a fresh machine) fails the test at once instead of silently taking CI's time.
- torch's AdamW as the client optimizer (or `torch_adam` in a config optimizer): DeepSpeed's
  own Adam variants are compiled ops.
- Megatron's CPU patches (megatron_trace.megatron.spawn) stay off: they rewrite torch.cuda and
  Tensor.type() process-wide, which DeepSpeed does not need and must not see.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import traceback

import torch

from megatron_trace.megatron.spawn import _free_port, run_workers, save_result


def cpu_environment() -> None:
    """Environment for DeepSpeed on the CPU; call before deepspeed is imported."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the FP4 kernels, as tests/conftest.py sets it
    torch.set_num_threads(1)


def _refuse_jit(self, verbose=True):
    raise RuntimeError(f"DeepSpeed would JIT-compile its {self.name} op; the CPU test harness allows none "
                       "(use torch's optimizers, see tests/support/deepspeed_cpu.py)")


def patch_deepspeed() -> None:
    """No shm_comm op at init_distributed and no JIT compile of any other op (see the module docstring)."""
    import deepspeed.comm.torch  # noqa: F401 - loads the module patched below
    from deepspeed.ops.op_builder.builder import OpBuilder

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    OpBuilder.jit_load = _refuse_jit


def init_distributed(rank: int, world: int, port: int) -> None:
    """DeepSpeed's backend on a gloo process group of `world` CPU processes (env:// rendezvous)."""
    cpu_environment()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    patch_deepspeed()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def initialize(model: torch.nn.Module, ds_config: dict, **adamw):
    """deepspeed.initialize(model, optimizer, config) -> the engine. The optimizer is
    torch.optim.AdamW(model.parameters(), **adamw), or the config's own "optimizer" (Adam or
    AdamW) made to use torch's implementation (`torch_adam`): nothing is compiled."""
    import deepspeed

    config = copy.deepcopy(ds_config)
    optimizer = None
    if "optimizer" in config:
        if adamw:
            raise ValueError(f"AdamW arguments {sorted(adamw)} given with the config's own optimizer")
        if config["optimizer"].get("type", "").lower() not in ("adam", "adamw"):
            raise ValueError(f"optimizer type {config['optimizer'].get('type')!r}: the CPU harness takes Adam or AdamW")
        config["optimizer"].setdefault("params", {})["torch_adam"] = True
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: full weight, the parameter's shape and dtype} copied out of `model` (the engine's
    module) on every rank: ZeRO-3's partitions gathered all at once (a tiny model's worth;
    the trainer's weight sync gathers one parameter at a time), a no-op under ZeRO-1/2."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone() for name, p in params.items()}


def _worker(rank, fn, world, port, kwargs, outdir):
    try:
        init_distributed(rank, world, port)
        result = {"ok": fn(rank, **kwargs)}
    except Exception:  # noqa: BLE001 - reported to the parent, which raises
        result = {"error": traceback.format_exc()}
    save_result(result, outdir, rank)
    with contextlib.suppress(Exception):  # best-effort teardown; the result is already saved
        torch.distributed.destroy_process_group()


def spawn(fn, world: int = 2, **kwargs) -> list:
    """fn(rank, **kwargs) on `world` CPU processes under DeepSpeed (fn importable by name: the
    processes are spawned); returns the results in rank order, RuntimeError with every failing
    rank's traceback."""
    return run_workers(_worker, world, (fn, world, _free_port(), kwargs))
