"""The DeepSpeed trainer's step primitives: packed micro-batches through a DeepSpeed engine over
transformers' Qwen3-MoE with TRACE's FP4 sites, the same contract as the Megatron trainer's
`megatron.schedule.run_microbatches` (a loss as a function of per-token log-probs, gradients of
the sum of the returned losses), and the optimizer step.

Gradient accumulation is the caller's: the engine runs with DeepSpeed's
`managed_gradient_accumulation: false`, so `backward` only accumulates and `step` reduces over the
data-parallel ranks (ZeRO-1/2/3) and updates, whatever the number of micro-batches an RL
mini-batch packs into. Data-parallel ranks average their gradients, as Megatron's DDP does.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..megatron import context
from ..megatron.schedule import MicroBatch
from ..modes import TrainerPrecision
from .model import set_precision

# what TRACE sets in every DeepSpeed config: the caller owns the accumulation boundary (the RL
# step's micro-batch count varies), one micro-batch row at a time (packed sequences)
REQUIRED_CONFIG = {"managed_gradient_accumulation": False, "train_micro_batch_size_per_gpu": 1,
                   "gradient_accumulation_steps": 1}


def deepspeed_config(user: dict) -> dict:
    """The DeepSpeed config the trainer runs: the user's (DeepSpeed's own keys, passed through)
    with REQUIRED_CONFIG; ValueError naming a user key that contradicts it."""
    clash = {k: user[k] for k in REQUIRED_CONFIG if k in user and user[k] != REQUIRED_CONFIG[k]}
    if clash:
        raise ValueError(f"DeepSpeed config {clash}: TRACE packs each micro-batch into one row and steps once per "
                         f"RL mini-batch, so it sets {REQUIRED_CONFIG}")
    if "train_batch_size" in user:
        raise ValueError("DeepSpeed config train_batch_size: the RL mini-batch decides the batch; leave it out")
    return {**user, **REQUIRED_CONFIG}


class DeepSpeedTrainer:
    """A DeepSpeed engine (deepspeed.initialize over a model patched by attach_fp4_sites) seen as
    TRACE's trainer."""

    TAG = "state"  # DeepSpeed's checkpoint tag inside a TRACE checkpoint directory

    def __init__(self, engine):
        self.engine = engine
        self.module = engine.module

    def set_precision(self, precision: TrainerPrecision | str) -> None:
        set_precision(self.module, precision)

    def run_microbatches(self, batches: list[MicroBatch],
                         loss_fn: Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]], *,
                         forward_only: bool = False) -> list[dict]:
        """Forward (and, unless forward_only, backward) of each packed micro-batch: loss_fn(i, logp)
        with logp float32 [T_i] = log p(targets[t] | ids[:t+1]) returns (loss, info); gradients
        accumulate until `step`. Returns each micro-batch's info."""
        infos = []
        for i, mb in enumerate(batches):
            context.activate(mb.guidance)
            try:
                with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
                    logits = self.engine(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                         cu_seq_lens_q=mb.packed_seq_params.cu_seqlens_q, use_cache=False).logits
                    logp = -F.cross_entropy(logits[0].float(), mb.targets[0], reduction="none")
                    loss, info = loss_fn(i, logp)
                    if not forward_only:
                        self.engine.backward(loss, scale_wrt_gas=False)
            finally:
                context.activate(None)
            infos.append(info)
        return infos

    def step(self) -> dict:
        """Reduce the accumulated gradients over the data-parallel ranks, clip (the config's
        gradient_clipping) and update; returns {"grad_norm": the norm before clipping}."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan")}

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        """DeepSpeed's checkpoint of the model and optimizer (every rank's partitions) at
        `directory`, atomically: written into a sibling temporary directory, renamed by rank 0 once
        every rank has finished, so a crash leaves the old state or the new one, never half of one.
        FileExistsError if `directory` exists. Call on every rank."""
        final = Path(directory)
        tmp = final.with_name(final.name + ".tmp")
        if final.exists():
            raise FileExistsError(f"DeepSpeed checkpoint {final} exists: TRACE never overwrites a checkpoint")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
        _barrier()
        self.engine.save_checkpoint(str(tmp), tag=self.TAG, save_latest=False)
        _barrier()
        if _rank() == 0:
            os.replace(tmp, final)
        _barrier()

    def load(self, directory: str | os.PathLike) -> None:
        """The model and optimizer state `save` wrote at `directory` (into an engine of the same
        configuration and world size). FileNotFoundError when there is none."""
        if not (Path(directory) / self.TAG).is_dir():
            raise FileNotFoundError(f"no DeepSpeed checkpoint at {directory} (no {self.TAG}/ in it)")
        path, _ = self.engine.load_checkpoint(str(directory), tag=self.TAG, load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint at {directory}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
