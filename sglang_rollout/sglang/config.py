"""The SGLang backend's configuration, and the sglang.Engine arguments it comes to."""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field, fields
from pathlib import Path

from megatron_trace.guidance import DEFAULT_TAU, Coding, LayerPolicy
from megatron_trace.modes import EnginePrecision

from .weight_payload import LOADER


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """precision: "fp4" (SGLang with quantization="trace_fp4") or "bf16" (SGLang unquantized).
    guide / coding / tau / scale_coding: the guidance policy and coding recorded (as the built-in
    engine's, `megatron_trace.guidance.capture`). model_id: written into every record. device: "cpu" or "cuda".
    num_blocks x block_size: the KV cache's token capacity (SGLang's max_total_tokens).
    tp_size: SGLang's tensor parallelism. weight_bucket_mb: the most a weight update sends in one
    SGLang call (a packed FP4 weight's parts travel together). release_memory: the engine shares
    its GPU with a trainer (colocated): release_memory() / resume_memory() free and retake SGLang's
    memory between rollouts (SGLang's enable_memory_saver on a GPU, which needs torch_memory_saver).
    checkpoint: an HF checkpoint directory (safetensors) that SGLang loads at its start through its
    own loaders, the FP4 sites packed after loading: the engine's weights are then version 0.
    None (default): SGLang starts on dummy weights with the FP4 sites created packed, and the
    trainer's weights arrive by update_weights (no BF16 shard is ever held).
    sglang: SGLang's own ServerArgs options, passed through (they override what this config derives)."""

    precision: EnginePrecision = EnginePrecision.FP4
    guide: str = "none"
    coding: str = "dense"
    tau: float = DEFAULT_TAU
    scale_coding: str = "lsb"
    model_id: str = "model"
    device: str = "cpu"
    num_blocks: int = 512
    block_size: int = 16
    tp_size: int = 1
    weight_bucket_mb: float = 512
    release_memory: bool = False
    checkpoint: str | None = None
    sglang: dict = field(default_factory=dict)

    @property
    def weight_bucket_bytes(self) -> int:
        return int(self.weight_bucket_mb * (1 << 20))

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "precision", EnginePrecision(self.precision))
        except ValueError as e:
            raise ValueError(f"EngineConfig.precision: {e}") from None
        LayerPolicy.parse(self.guide)
        object.__setattr__(self, "coding", Coding(self.coding).value)  # raises naming a bad coding
        if self.scale_coding not in ("lsb", "near"):
            raise ValueError(f"EngineConfig.scale_coding must be 'lsb' or 'near', got {self.scale_coding!r}")
        if self.guide != "none" and self.precision is not EnginePrecision.FP4:
            raise ValueError("EngineConfig.guide needs precision='fp4': guidance records FP4 rounding")
        if not self.weight_bucket_mb > 0:
            raise ValueError(f"EngineConfig.weight_bucket_mb must be > 0, got {self.weight_bucket_mb}")
        for name in ("num_blocks", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        unknown = sorted(set(self.sglang) - server_arg_names())
        if unknown:
            raise ValueError(f"EngineConfig.sglang (rollout.sglang): {unknown} are not fields of SGLang's ServerArgs")


@functools.cache
def server_arg_names() -> frozenset[str]:
    """The fields of the installed SGLang's ServerArgs, read from its source: importing SGLang
    in the caller (a trainer) would need the CPU import shims there (cpu_patches)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ValueError("rollout.backend=sglang: SGLang is not installed (the `sglang` extra of setup.cfg)")
    tree = ast.parse((Path(spec.origin).parent / "srt" / "server_args.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    return frozenset(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))


MOE_PADDING = 32  # SGLang pads the experts' width per moe-TP rank to a multiple of this (configs/update_config.py)


def check_layout(model_cfg, cfg: EngineConfig) -> None:
    """ValueError for an architecture the SGLang engine does not build, a layout SGLang would
    pad (the FP4 sites' rows must be the trainer's), or a checkpoint of another model."""
    model_cfg.require_built("the SGLang engine", "sglang")
    if cfg.checkpoint is not None:
        check_checkpoint(cfg.checkpoint, model_cfg)
    ep = int(cfg.sglang.get("ep_size", 1))
    if cfg.tp_size % ep:
        raise ValueError(f"EngineConfig: tp_size {cfg.tp_size} is not a multiple of SGLang's ep_size {ep}")
    if model_cfg.num_experts % ep:
        raise ValueError(f"EngineConfig: SGLang's ep_size {ep} does not divide the {model_cfg.num_experts} experts")
    moe_tp = cfg.tp_size // ep
    width = model_cfg.moe_intermediate_size
    if moe_tp > 1 and (width % moe_tp or (width // moe_tp) % MOE_PADDING):
        raise ValueError(f"EngineConfig: experts of intermediate size {width} over {moe_tp} moe-TP ranks: SGLang "
                         f"pads each rank's part to a multiple of {MOE_PADDING}, and padded FP4 rows are not the "
                         f"trainer's; choose tp_size / ep_size so that {width} / (tp / ep) is a multiple of "
                         f"{MOE_PADDING}")
    if model_cfg.num_attention_heads % cfg.tp_size:
        raise ValueError(f"EngineConfig: tp_size {cfg.tp_size} does not divide the {model_cfg.num_attention_heads} "
                         "attention heads")
    if cfg.device == "cpu" and cfg.tp_size > 1:
        # SGLang's CPU tensor parallelism pads every FFN width, the experts' under EP too, to a
        # multiple of tp_size x 32 (configs/update_config.py, adjust_config_with_unaligned_cpu_tp)
        step = cfg.tp_size * MOE_PADDING
        widths = {"moe_intermediate_size": width}
        if model_cfg.first_k_dense_replace:
            widths["intermediate_size"] = model_cfg.intermediate_size
        for name, w in widths.items():
            if w % step:
                raise ValueError(f"EngineConfig: {name} {w} on the CPU at tp_size {cfg.tp_size}: SGLang pads it to a "
                                 f"multiple of {step}, and padded FP4 rows are not the trainer's")


def check_checkpoint(path: str, model_cfg) -> None:
    """ValueError unless `path` is an HF checkpoint of exactly `model_cfg` (its config.json and
    its tensors' names and shapes: megatron_trace.checkpoint.hf), which SGLang's loaders read."""
    from megatron_trace.checkpoint.hf import HFCheckpoint

    found = HFCheckpoint(path).model_cfg
    if found != model_cfg:
        differ = [f.name for f in fields(found) if getattr(found, f.name) != getattr(model_cfg, f.name)]
        raise ValueError(f"EngineConfig.checkpoint {path}: its config.json is not the engine's model ({differ} differ)")


def server_args(model_dir: str, cfg: EngineConfig, mla: bool = False) -> dict:
    """sglang.Engine's arguments for this config (cfg.sglang's entries win); model_dir: a
    directory with the model's config.json, SGLang's model path unless cfg.checkpoint is given;
    mla: the model is of the DeepSeek-V3 family (TRACE's MLA forward, `mla.py`)."""
    cpu, fp4 = cfg.device == "cpu", cfg.precision is EnginePrecision.FP4
    args = dict(model_path=cfg.checkpoint or model_dir, load_format="auto" if cfg.checkpoint else "dummy",
                device=cfg.device, tp_size=cfg.tp_size, dtype="bfloat16",
                skip_tokenizer_init=True, random_seed=0, log_level="error",
                max_total_tokens=cfg.num_blocks * cfg.block_size, enable_return_routed_experts=True,
                quantization="trace_fp4" if fp4 else None,
                custom_weight_loader=[LOADER], sampling_backend="pytorch",
                # TRACE's FP4 KV cache is read by TRACE's attention backend (the plugin's)
                attention_backend="trace_fp4" if fp4 else "torch_native" if cpu else "triton")
    if fp4 and cfg.guide != "none":
        # guidance capture stages decode graphs' rows on the device (capture.graph_capture); prefill
        # graphs (piecewise, per layer) are not hooked
        args["disable_prefill_cuda_graph"] = True
    if mla:
        # TRACE's MLA forward loops over requests on the host (no graphs); the shared experts run as
        # their own FFN, as the trainer's (SGLang would fuse them into the routed experts)
        args |= dict(disable_cuda_graph=True, disable_shared_experts_fusion=True)
    if cfg.release_memory and not cpu:
        args["enable_memory_saver"] = True  # what release_memory frees (torch_memory_saver's regions)
    if cpu:
        # CPU: no CUDA graphs; the overlap scheduler's host copies alias the device buffers on the
        # CPU and corrupt routed experts (docs/notes/sglang-integration.md)
        args |= dict(disable_cuda_graph=True, disable_overlap_schedule=True, mem_fraction_static=0.1)
    return args | cfg.sglang
