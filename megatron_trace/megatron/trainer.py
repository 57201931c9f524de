"""The Megatron trainer as the RL loop sees it (`rl.trainer.Trainer`): this rank's TraceGPTModel
under any TP / EP / PP / DP layout, Megatron's DDP and optimizer (`megatron.optimizer`), its
schedule, its sharded weight sync and its distributed checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..checkpoint.dist import load_model, save_model
from ..config import OptimSection
from ..model_config import ModelConfig
from ..modes import TrainerPrecision
from . import model as model_lib
from .qat import cached_weights
from .schedule import MicroBatch, run_microbatches
from .spec import LOCAL_LINEARS, Linears
from .sync import trainer_buckets


def linears_for(transformer_impl: str) -> Linears:
    """The linears of Megatron's `transformer_impl`: "local" (TRACE's FP4 linears) or
    "transformer_engine" (TE's, `te.spec`; RuntimeError naming what is missing where TE cannot run)."""
    if transformer_impl == "local":
        return LOCAL_LINEARS
    if transformer_impl != "transformer_engine":
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {transformer_impl!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.transformer_impl=transformer_engine needs a GPU: Transformer Engine's modules "
                           "do not run on the CPU (use trainer.transformer_impl=local there)")
    try:
        from ..te.spec import te_linears
    except (ImportError, RuntimeError) as e:  # TE's Python without its core library raises RuntimeError
        raise RuntimeError("trainer.transformer_impl=transformer_engine needs Transformer Engine >= 2.19 with its "
                           "PyTorch extension (TRACE pins 2.20.2; bench/gpu_te.sh installs it on a GPU machine): "
                           f"{type(e).__name__}: {e}") from e
    return te_linears()


class MegatronTrainer:
    """`model`: this rank's TraceGPTModel; the optimizer (`megatron.optimizer.TrainerOptimizer`:
    Megatron's DDP over the model, built at the first `start_phase`, or one given) is absent for a
    frozen model such as the KL reference."""

    backend = "megatron"
    scales_gradients = True  # Megatron's DDP rescales reduced gradients before the step (scale_grads)

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, optim: OptimSection | None = None,
                 optimizer=None, linears: Linears = LOCAL_LINEARS, megatron_options: dict | None = None):
        self.model, self.model_cfg, self.optim = model, model_cfg, optim or OptimSection()
        self.optimizer, self.linears = optimizer, linears
        self.megatron_options = dict(megatron_options or {})  # trainer.megatron: the reference model's too

    @classmethod
    def build(cls, model_cfg: ModelConfig, optim: OptimSection, *, recompute: str | None = None,
              hf: str = "", megatron: str = "", transformer_impl: str = "local",
              megatron_options: dict | None = None) -> MegatronTrainer:
        """This rank's model in BF16 compute (as the engine), its weights from the HF checkpoint
        `hf` or the Megatron checkpoint `megatron` (random otherwise), its linears Megatron's
        `transformer_impl` ("local" or "transformer_engine"), `megatron_options` Megatron's own
        TransformerConfig settings (`trainer.megatron`)."""
        linears = linears_for(transformer_impl)
        model = model_lib.build_model(model_cfg, "bf16", grouped_gemm=True, recompute=recompute, linears=linears,
                                      megatron_options=megatron_options)
        if hf:
            from ..checkpoint.hf import HFCheckpoint
            from .weights import load_full_state_dict

            load_full_state_dict(model, HFCheckpoint(hf))
        elif megatron:
            load_model(model, megatron)
        return cls(model, model_cfg, optim, linears=linears, megatron_options=megatron_options)

    # -- layout -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sequence_padding(self, num_tokens: int) -> int:
        return model_lib.sequence_padding(num_tokens, self.linears.token_multiple)

    # -- forward and backward -----------------------------------------------------------------
    def set_precision(self, precision: TrainerPrecision | str) -> None:
        model_lib.set_precision(self.model, precision)

    def fp4_sites(self) -> list:
        return model_lib.fp4_sites(self.model)

    def run_microbatches(self, batches: list[MicroBatch], loss_fn, *, forward_only: bool = False) -> list[dict]:
        """`megatron.schedule.run_microbatches` through the DDP wrapper when training (gradients
        accumulate in its buffers until `step`). The weights do not change within the call, so
        each FP4 weight is quantized once for all its micro-batches (`qat.cached_weights`)."""
        model = self.model if forward_only else self._require_optimizer().ddp
        with cached_weights():
            return run_microbatches(model, batches, loss_fn, forward_only=forward_only)

    # -- optimizer ----------------------------------------------------------------------------
    def start_phase(self, lr: float) -> None:
        """A fresh optimizer at learning rate `lr` (Megatron's DDP is built once, the optimizer
        afresh per phase)."""
        if self.optimizer is None:
            from .optimizer import TrainerOptimizer

            self.optimizer = TrainerOptimizer(self.model, lr, self.optim)
        else:
            self.optimizer.restart(lr)

    def _require_optimizer(self):
        if self.optimizer is None:
            raise RuntimeError("the trainer has no optimizer: call start_phase(lr) before training")
        return self.optimizer

    def zero_grad(self) -> None:
        self._require_optimizer().zero_grad()

    def scale_grads(self, factor: float) -> None:
        self._require_optimizer().scale_grads(factor)

    def step(self) -> dict:
        return self._require_optimizer().step()

    # -- weights and checkpoints --------------------------------------------------------------
    def weight_buckets(self, fp4: bool, max_bytes: int):
        """This rank's share of the weights, packed for the engine (megatron.sync); collective."""
        return trainer_buckets(self.model, fp4, max_bytes)

    def save(self, directory: Path) -> None:
        """`directory`/model (a Megatron distributed checkpoint: any layout loads it, and
        trace-export-fp4 --megatron exports it) and `directory`/optimizer. Call on every rank."""
        save_model(self.model, self.model_cfg, directory / "model")
        self._require_optimizer().save(directory / "optimizer")

    def check_checkpoint(self, directory: Path) -> None:
        from .optimizer import has_optimizer_checkpoint

        if not has_optimizer_checkpoint(directory / "optimizer"):
            raise ValueError(f"cannot resume from {directory}: it has no optimizer/ distributed checkpoint (written "
                             "by a TRACE before Megatron's optimizer; start a new output_dir or set "
                             "checkpoint.resume=false)")

    def load_weights(self, directory: Path) -> None:
        load_model(self.model, directory / "model")

    def load_optimizer(self, directory: Path) -> None:
        self._require_optimizer().load(directory / "optimizer")

    def reference(self, path: Path, resumed: bool) -> MegatronTrainer:
        """The frozen reference of the KL penalty: this model as it is now, kept at `path` (a
        Megatron checkpoint) so that a resumed run penalises against the same one."""
        reference = model_lib.build_model(self.model_cfg, "bf16", grouped_gemm=True, linears=self.linears,
                                          megatron_options=self.megatron_options)
        if resumed and path.exists():
            load_model(reference, path)
        else:
            if torch.distributed.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)  # of an earlier run in this output_dir
            reference.load_state_dict(self.model.state_dict())  # the same layout: the same local names
            save_model(reference, self.model_cfg, path)  # collective: its first step orders the removal above
        for p in reference.parameters():
            p.requires_grad_(False)
        return MegatronTrainer(reference, self.model_cfg, linears=self.linears, megatron_options=self.megatron_options)
