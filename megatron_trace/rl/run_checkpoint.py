"""The RL run's own checkpoints, and resuming from the latest one (the model checkpoint formats,
HF and Megatron conversion and FP4 export, are the `megatron_trace.checkpoint` package).

A checkpoint is a directory `<output_dir>/checkpoints/<phase>-<step>/` holding the trainer's
own files (`Trainer.save`), with the Megatron trainer
    model/      the trainer as a Megatron distributed checkpoint (checkpoint.dist; loads under any
                layout and exports with trace-export-fp4 --megatron),
    optimizer/  the optimizer's FP32 main parameters and AdamW moments, a Megatron distributed
                checkpoint too (`megatron.optimizer`): a run saved under one data-parallel size
                and TP/PP layout resumes under another;
with the DeepSpeed trainer
    model/      the weights as an HF checkpoint (transformers and trace-export-fp4 --hf read it),
    deepspeed/  DeepSpeed's checkpoint (every rank's ZeRO partitions, the optimizer state);
and
    state.pt    what else the run needs to continue exactly as it would have: the task's draw
                state and torch's RNG state, the phase and next step, the engine's weight
                version, and the run's configuration.
It is written into a hidden temporary directory and renamed into place; then the one-line file
`checkpoints/latest` is replaced atomically. A run killed at any point resumes from the last
complete checkpoint; metrics rows written after it are dropped and computed again.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import upgrade_flat_config

LATEST = "latest"
PHASES = ("sft", "rl")
_NAME = re.compile(r"(sft|rl)-(\d{6})")


@dataclass(kw_only=True)
class RunState:
    """phase: "sft" or "rl"; step: the next step of that phase; weight_version: the engine's;
    guide: the resolved guidance policy of a `budget:` run."""

    phase: str = "sft"
    step: int = 0
    weight_version: int = 0
    guide: str = ""  # the guidance policy a `budget:` policy resolved to ("layers:..."), once measured


def _rank() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def save_checkpoint(out_dir: str | os.PathLike, trainer, task_state: dict, state: RunState,
                    run_config: dict, keep: int = 2) -> Path:
    """Write one checkpoint (see module docstring); keep the newest `keep`. Call on every trainer
    rank (`trainer`: an `rl.trainer.Trainer`): each writes its shards of the model and of the
    optimizer state."""
    rank, world = _rank()
    root = Path(out_dir) / "checkpoints"
    final = root / f"{state.phase}-{state.step:06d}"
    name = [f".partial-{uuid.uuid4().hex[:8]}"]
    if world > 1:  # every rank writes into the directory rank 0 names
        torch.distributed.broadcast_object_list(name, src=0)
    tmp = root / name[0]
    if rank == 0:
        tmp.mkdir(parents=True)
    if world > 1:
        torch.distributed.barrier()  # the directory exists before any rank writes into it
    trainer.save(tmp)
    if rank == 0:
        torch.save({"state": dataclasses.asdict(state), "task": task_state, "torch_rng": torch.get_rng_state(),
                    "config": run_config, "world": world}, tmp / "state.pt")
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        if final.exists():  # left by a run killed before it updated `latest`: never the latest itself
            shutil.rmtree(final)
        tmp.rename(final)
        pointer = root / f".{LATEST}-{uuid.uuid4().hex[:8]}"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
        for old in _checkpoints(root)[:-keep]:
            shutil.rmtree(old)
        for stale in root.glob(".partial-*"):  # of killed saves
            shutil.rmtree(stale, ignore_errors=True)
    if world > 1:
        torch.distributed.barrier()
    return final


def _checkpoints(root: Path) -> list[Path]:
    """The run's checkpoint directories, oldest first (every SFT one before every RL one)."""
    found = [(PHASES.index(m[1]), int(m[2]), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for *_, p in sorted(found)]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The directory `checkpoints/latest` names, or None for a run without checkpoints."""
    pointer = Path(out_dir) / "checkpoints" / LATEST
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "state.pt").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path, trainer, run_config: dict, resumable_keys: tuple[str, ...]) -> dict:
    """Load the trainer's weights (an `rl.trainer.Trainer`) from checkpoint `path`; return its
    state.pt contents and, as "path", `path` (the optimizer loads its state from there).

    Raises ValueError naming the first configuration key that differs from the checkpoint's,
    other than `resumable_keys` (e.g. the number of steps, which a resumed run may extend)."""
    saved = torch.load(path / "state.pt", weights_only=False)
    saved["config"] = upgrade_flat_config(saved["config"])
    trainer.check_checkpoint(path)
    saved["path"] = path
    for key in sorted(set(saved["config"]) | set(run_config)):
        if key not in resumable_keys and saved["config"].get(key) != run_config.get(key):
            raise ValueError(f"cannot resume from {path}: config {key} was {saved['config'].get(key)!r}, "
                             f"now {run_config.get(key)!r} (use a new output_dir or checkpoint.resume=false)")
    trainer.load_weights(path)
    return saved
