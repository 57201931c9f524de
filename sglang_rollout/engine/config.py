"""The engine's configuration (one typed schema, checked at construction)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_trace.guidance import Coding, LayerPolicy
from megatron_trace.modes import EnginePrecision


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """precision: an EnginePrecision, "bf16" or "fp4" (W4A4 + FP4 KV cache, docs/design.md section 3).
    block_size: tokens per KV-cache block. num_blocks: KV-cache blocks the sequences use (the token
    capacity is block_size * num_blocks; with CUDA graphs the cache holds one more, their scratch).
    max_batch_tokens: new tokens per forward (prefill chunks + decodes).
    guide: layer policy of the guidance records ("none", "all", "deep:K", "layers:..."; routed
    experts are returned for every layer regardless). coding / tau / scale_coding: as
    `megatron_trace.guidance.capture`. model_id: written into every record's header.
    device: "cpu" or "cuda". kernels: "auto" (on CUDA: Triton, and the CUDA C++ decode kernels of
    trace_kernels.fp4.cuda_decode where they apply), "torch" or "triton" (Triton only; its kernels
    also run on the CPU under TRITON_INTERPRET=1, slowly: for tests).
    cuda_graph_max_batch: decode steps of up to this many sequences replay CUDA graphs (CUDA
    only; one graph per batch-size bucket, captured on first use); 0 runs every step eagerly.
    overlap: once no prompt waits, launch each decode step before taking in the last one's
    results (its tokens stay on the device), so the host's bookkeeping runs while the GPU
    computes; the same outputs as without."""

    precision: EnginePrecision = EnginePrecision.FP4
    block_size: int = 16
    num_blocks: int = 512
    max_batch_tokens: int = 2048
    guide: str = "none"
    coding: str = "dense"
    tau: float = 2.0
    scale_coding: str = "lsb"
    model_id: str = "tiny"
    device: str = "cpu"
    kernels: str = "auto"
    cuda_graph_max_batch: int = 256
    overlap: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "precision", EnginePrecision(self.precision))
        except ValueError as e:
            raise ValueError(f"EngineConfig.precision: {e}") from None
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"EngineConfig.cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        for name in ("block_size", "num_blocks", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        LayerPolicy.parse(self.guide)  # raises naming the bad policy
        Coding(self.coding)
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"EngineConfig.kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}")
        if self.guide != "none" and self.precision is not EnginePrecision.FP4:
            raise ValueError("EngineConfig.guide needs precision='fp4': guidance records FP4 rounding")
