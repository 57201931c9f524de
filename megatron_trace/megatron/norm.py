"""RMSNorm for the trainer's layers, and the one that also quantizes MLA's KV latent."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from .qat import SiteHolder


class TraceRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm (float32 weight) that also runs under sequence parallelism.

    Megatron's local norm refuses sequence parallelism without Transformer Engine or Apex, yet
    MoE layers need it with tensor parallelism. The norm is pointwise over tokens, so it only
    has to mark its weight `sequence_parallel`: finalize_model_grads then all-reduces the
    weight's gradient over the tensor-parallel group (each rank saw other tokens, or for QK
    norms other heads).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class LatentNorm(SiteHolder, TraceRMSNorm):
    """MLA's `kv_a_layernorm`. Its output, the compressed KV latent, is what the engine's KV cache
    stores (docs/design.md section 3.1), so it passes through the `kv` site: NVFP4 with one global
    scale per token row, as the engine quantizes it into the cache. `kv_b` then reads it as is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.fp4_site is None else self.fp4_site.quantize_input(y)
