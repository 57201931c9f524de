"""The trainer as the RL loop sees it, whichever backend runs it (`trainer.backend`):
`megatron.trainer.MegatronTrainer` (Megatron-core under any TP / EP / PP / DP layout) or
`deepspeed.trainer.DeepSpeedTrainer` (transformers' Qwen3-MoE under DeepSpeed ZeRO). Both carry
the same FP4 sites, guidance and routing replay, so the RL step, SFT, weight sync, checkpoints,
flip counting and the audit are written once against this interface."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from ..config import TrainConfig
from ..megatron.schedule import MicroBatch
from ..model_config import ModelConfig
from ..modes import TrainerPrecision


class Trainer(Protocol):
    """What a trainer backend provides (call every method on every trainer rank)."""

    backend: str  # "megatron" or "deepspeed"
    model: torch.nn.Module  # this rank's module (its parameters' device is the trainer's)
    model_cfg: ModelConfig
    scales_gradients: bool  # scale_grads works between backward and step (else the loss carries the scale)

    @property
    def device(self) -> torch.device:
        """Where the trainer's parameters and micro-batches live."""

    def sequence_padding(self, num_tokens: int) -> int:
        """Tokens to append to a packed micro-batch of num_tokens (sequence parallelism)."""

    def set_precision(self, precision: TrainerPrecision | str) -> None:
        """Switch every FP4 site to `precision`."""

    def fp4_sites(self) -> list:
        """This rank's FP4 sites (megatron.qat.FP4Site)."""

    def run_microbatches(self, batches: list[MicroBatch], loss_fn: Callable[[int, torch.Tensor], tuple],
                         *, forward_only: bool = False) -> list[dict]:
        """loss_fn(i, logp float32 [T_i]) -> (loss, info) per packed micro-batch; unless
        forward_only, gradients of the sum of the losses accumulate until `step`. The infos come
        back with their tensor values on the host (`megatron.schedule.infos_to_host`), so a loss
        can leave its statistics on the device."""

    def start_phase(self, lr: float) -> None:
        """A fresh optimizer state at learning rate `lr` (a new phase: SFT, then RL)."""

    def zero_grad(self) -> None: ...

    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced gradients by `factor` (only where scales_gradients)."""

    def step(self) -> dict:
        """Reduce, clip and update; {"grad_norm": before clipping, "lr": the step's}."""

    def weight_buckets(self, fp4: bool, max_bytes: int):
        """This rank's share of the weights as engine buckets (weight_buckets.Buckets); collective."""

    def save(self, directory: Path) -> None:
        """The model and the optimizer state under `directory` (inside a run checkpoint)."""

    def check_checkpoint(self, directory: Path) -> None:
        """ValueError naming what a run checkpoint at `directory` lacks for this backend."""

    def load_weights(self, directory: Path) -> None: ...

    def load_optimizer(self, directory: Path) -> None:
        """The optimizer state `save` wrote (after start_phase)."""

    def reference(self, path: Path, resumed: bool) -> Trainer:
        """A frozen copy of the model as it is now, kept at `path` for a resumed run."""


def build_trainer(cfg: TrainConfig, model_cfg: ModelConfig) -> Trainer:
    """The run's trainer (trainer.backend) with its weights: model.hf, model.megatron, or random."""
    if cfg.trainer.backend == "deepspeed":
        from ..deepspeed.trainer import DeepSpeedTrainer

        return DeepSpeedTrainer.build(model_cfg, cfg.model.hf, cfg.trainer.deepspeed, cfg.optim)
    from ..megatron.trainer import MegatronTrainer

    return MegatronTrainer.build(model_cfg, cfg.optim, recompute=None if cfg.dist.recompute == "none"
                                 else cfg.dist.recompute, hf=cfg.model.hf, megatron=cfg.model.megatron,
                                 transformer_impl=cfg.trainer.transformer_impl, megatron_options=cfg.trainer.megatron)
