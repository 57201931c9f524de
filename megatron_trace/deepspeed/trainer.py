"""The DeepSpeed trainer as the RL loop sees it (`rl.trainer.Trainer`): a DeepSpeed engine over
transformers' Qwen3-MoE with TRACE's FP4 sites, loaded from the run's HF checkpoint. Packed
micro-batches run with the Megatron trainer's contract (`megatron.schedule.run_microbatches`: a
loss as a function of per-token log-probs, gradients of the sum of the returned losses); the
optimizer is AdamW inside the engine (torch's, unless DeepSpeed's config names its own), with the
learning rate and its warm-up set by TRACE per phase.

Gradient accumulation is the caller's: the engine runs with DeepSpeed's
`managed_gradient_accumulation: false`, so `backward` only accumulates and `step` reduces over the
data-parallel ranks (ZeRO-1/2/3) and updates, whatever the number of micro-batches an RL
mini-batch packs into. Data-parallel ranks average their gradients, as Megatron's DDP does.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import OptimSection
from ..megatron import context
from ..megatron.schedule import MicroBatch, infos_to_host
from ..model_config import ModelConfig
from ..modes import TrainerPrecision
from . import model as model_lib
from .weights import LayerBuckets, save_hf

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
    if user.get("fp16", {}).get("enabled"):
        raise ValueError("DeepSpeed config fp16: TRACE's trainer computes in BF16, as the engines do; use bf16")
    return {"bf16": {"enabled": True}, "steps_per_print": 10**9, **user, **REQUIRED_CONFIG}


def init_distributed() -> None:
    """DeepSpeed's communication backend over torch.distributed's process group (NCCL on a GPU,
    gloo on the CPU), a one-rank group first when none is up (a colocated run)."""
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        # one process outside a launcher: the variables DeepSpeed reads (zero.Init: LOCAL_RANK)
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        from ..megatron.spawn import _free_port

        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def _zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def load_hf_model(hf_dir: str | Path, config: dict, precision: TrainerPrecision | str = "bf16") -> torch.nn.Module:
    """transformers' Qwen3-MoE from `hf_dir` in BF16 with TRACE's FP4 sites; under ZeRO-3 built
    partitioned (transformers' HfDeepSpeedConfig: no rank holds the whole model)."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(config) if _zero_stage(config) == 3 else None  # noqa: F841 - alive while loading
    return model_lib.attach_fp4_sites(Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16), precision)


class DeepSpeedTrainer:
    """`engine`: a DeepSpeed engine over a model patched by attach_fp4_sites (None for a frozen
    module outside DeepSpeed: `module` then runs the forwards)."""

    backend = "deepspeed"
    SUBDIR = "deepspeed"  # DeepSpeed's checkpoint inside a run checkpoint
    TAG = "state"  # DeepSpeed's checkpoint tag

    def __init__(self, engine, model_cfg: ModelConfig | None = None, optim: OptimSection | None = None,
                 module: torch.nn.Module | None = None, config: dict | None = None):
        self.engine, self.model_cfg, self.optim = engine, model_cfg, optim or OptimSection()
        self.module = engine.module if engine is not None else module
        self.model = self.module
        self.config = config or {}
        self.lr, self.phase_steps = 0.0, 0

    @classmethod
    def build(cls, model_cfg: ModelConfig, hf_dir: str, user_config: dict, optim: OptimSection) -> DeepSpeedTrainer:
        """The HF checkpoint `hf_dir` in a DeepSpeed engine of `user_config` (DeepSpeed's own keys,
        see deepspeed_config), with torch's AdamW (optim.weight_decay) unless the config has its own
        optimizer, and optim.clip_grad unless it sets gradient_clipping. ValueError for an
        architecture beyond Qwen3-MoE's (ModelConfig.unbuilt names it)."""
        model_cfg.require_built("the DeepSpeed trainer")
        import deepspeed

        config = deepspeed_config({"gradient_clipping": optim.clip_grad, **copy.deepcopy(user_config)})
        model = load_hf_model(hf_dir, config)
        optimizer = None
        if "optimizer" not in config:  # DeepSpeed's own Adam variants are compiled ops; torch's are not
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=optim.weight_decay)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return cls(engine, model_cfg, optim, config=config)

    # -- layout -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def sequence_padding(self, num_tokens: int) -> int:
        return 0  # no sequence parallelism

    # -- forward and backward -----------------------------------------------------------------
    def set_precision(self, precision: TrainerPrecision | str) -> None:
        model_lib.set_precision(self.module, precision)

    def fp4_sites(self) -> list:
        return model_lib.fp4_sites(self.module)

    def run_microbatches(self, batches: list[MicroBatch],
                         loss_fn: Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]], *,
                         forward_only: bool = False) -> list[dict]:
        """Forward (and, unless forward_only, backward) of each packed micro-batch: loss_fn(i, logp)
        with logp float32 [T_i] = log p(targets[t] | ids[:t+1]) returns (loss, info); gradients
        accumulate until `step`. Returns each micro-batch's info (tensor values on the host:
        `infos_to_host`)."""
        if not forward_only and self.engine is None:
            raise RuntimeError("a frozen model (no DeepSpeed engine) runs forward_only")
        forward = self.engine if self.engine is not None else self.module
        infos = []
        for i, mb in enumerate(batches):
            context.activate(None if mb.guidance is None else mb.guidance.to(mb.input_ids.device))
            try:
                with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
                    logits = forward(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                     cu_seq_lens_q=mb.packed_seq_params.cu_seqlens_q, use_cache=False).logits
                    logp = -F.cross_entropy(logits[0].float(), mb.targets[0], reduction="none")
                    loss, info = loss_fn(i, logp)
                    if not forward_only:
                        self.engine.backward(loss, scale_wrt_gas=False)
            finally:
                context.activate(None)
            infos.append(info)
        return infos_to_host(infos)

    # -- optimizer ----------------------------------------------------------------------------
    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside DeepSpeed's wrappers (ZeRO's, BF16_Optimizer)."""
        opt = self.engine.optimizer
        while not isinstance(opt, torch.optim.Optimizer):
            opt = opt.optimizer
        return opt

    def start_phase(self, lr: float) -> None:
        """A new phase at learning rate `lr`: AdamW's moments dropped (the FP32 master weights,
        which are the model's, stay), the warm-up restarted."""
        self._torch_optimizer().state.clear()
        self.lr, self.phase_steps = lr, 0

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # DeepSpeed reduces, clips and updates in one `step()`: the gradients cannot be rescaled in
    # between, so a loss's normaliser must be known before its backward (rl.step does so)
    scales_gradients = False

    def step(self) -> dict:
        """Reduce the accumulated gradients over the data-parallel ranks, clip and update at the
        phase's learning rate (linear warm-up over optim.lr_warmup_steps); returns
        {"grad_norm": the norm before clipping, "lr": the step's learning rate}."""
        self.phase_steps += 1
        warmup = self.optim.lr_warmup_steps
        lr = self.lr * min(1.0, self.phase_steps / warmup) if warmup else self.lr
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "lr": lr}

    # -- weights and checkpoints --------------------------------------------------------------
    def weight_buckets(self, fp4: bool, max_bytes: int):
        """The whole model, packed for the engine, made a layer at a time on rank 0 (empty
        elsewhere); every rank takes part in ZeRO-3's gathers while rank 0's buckets are iterated."""
        return LayerBuckets(self.module, self.model_cfg, fp4, max_bytes, sender=_rank() == 0)

    def save(self, directory: Path) -> None:
        """`directory`/model: the weights as an HF checkpoint (transformers and trace-export-fp4
        --hf read it); `directory`/deepspeed: DeepSpeed's own checkpoint (every rank's
        partitions, the optimizer's state and TRACE's phase). Call on every rank."""
        save_hf(self.module, self.model_cfg, directory / "model")
        self.engine.save_checkpoint(str(directory / self.SUBDIR), tag=self.TAG, save_latest=True,
                                    client_state={"trace_phase": {"lr": self.lr, "steps": self.phase_steps}})
        _barrier()

    def check_checkpoint(self, directory: Path) -> None:
        if not (directory / self.SUBDIR / self.TAG).is_dir():
            raise ValueError(f"cannot resume from {directory}: it has no {self.SUBDIR}/ checkpoint (written by the "
                             "Megatron trainer? trainer.backend must match the run's)")

    def load_weights(self, directory: Path) -> None:
        self._load(directory, optimizer=False)

    def load_optimizer(self, directory: Path) -> None:
        state = self._load(directory, optimizer=True)
        phase = state.get("trace_phase", {})
        self.lr, self.phase_steps = phase.get("lr", self.lr), phase.get("steps", 0)

    def _load(self, directory: Path, optimizer: bool) -> dict:
        path, client = self.engine.load_checkpoint(str(directory / self.SUBDIR), tag=self.TAG, load_module_strict=True,
                                                   load_optimizer_states=optimizer,
                                                   load_lr_scheduler_states=optimizer, load_module_only=not optimizer)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint at {directory / self.SUBDIR}")
        return client or {}

    def reference(self, path: Path, resumed: bool) -> DeepSpeedTrainer:
        """The frozen reference of the KL penalty: this model as it is now, kept at `path` (an HF
        checkpoint) so that a resumed run penalises against the same one. Under ZeRO-3 it is
        partitioned like the trainer (a DeepSpeed engine without optimizer), else a plain module."""
        if not (resumed and path.exists()):
            if _rank() == 0:
                shutil.rmtree(path, ignore_errors=True)  # of an earlier run in this output_dir
            _barrier()
            save_hf(self.module, self.model_cfg, path)
        config = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": 3 if _zero_stage(self.config) == 3 else 0}}
        module = load_hf_model(path, config)
        for p in module.parameters():
            p.requires_grad_(False)
        if _zero_stage(self.config) == 3:
            import deepspeed

            engine, *_ = deepspeed.initialize(model=module, config=config)
            return DeepSpeedTrainer(engine, self.model_cfg, config=config)
        return DeepSpeedTrainer(None, self.model_cfg, module=module.to(self.device).eval(), config=config)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
