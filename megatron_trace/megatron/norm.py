"""RMSNorm for the trainer's layers, and the one that also quantizes MLA's KV latent."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from trace_kernels.norm_rope import rms_norm, rms_norm_backward

from .qat import SiteHolder


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        x = x.contiguous()  # (QK norms get strided views of qkv) one copy, for both passes
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.backend = eps, backend
        return rms_norm(x, weight, eps, backend=backend)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(grad.contiguous(), x, weight, ctx.eps, backend=ctx.backend)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """F.rms_norm(x, (N,), weight, eps) of x [..., N] and a float32 weight [N], in x's dtype, with
    its gradients. BF16 input on a GPU (or backend="triton": the CPU interpreter, for tests) runs
    `trace_kernels.norm_rope`'s kernels, one each way: torch has no fused kernel for BF16 input
    with an FP32 weight, and its composite runs about seven elementwise kernels forward and ten
    backward over FP32 temporaries. Anything else: torch's own."""
    fused = backend == "triton" or (backend == "auto" and x.is_cuda)
    if fused and x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
        return _RMSNorm.apply(x, weight, eps, "triton")
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


class TraceRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm (float32 weight) that also runs under sequence parallelism, fused on a GPU
    (`fused_rms_norm`).

    Megatron's local norm refuses sequence parallelism without Transformer Engine or Apex, yet
    MoE layers need it with tensor parallelism. The norm is pointwise over tokens, so it only
    has to mark its weight `sequence_parallel`: finalize_model_grads then all-reduces the
    weight's gradient over the tensor-parallel group (each rank saw other tokens, or for QK
    norms other heads).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


class LatentNorm(SiteHolder, TraceRMSNorm):
    """MLA's `kv_a_layernorm`. Its output, the compressed KV latent, is what the engine's KV cache
    stores (docs/design.md section 3.1), so it passes through the `kv` site: NVFP4 with one global
    scale per token row, as the engine quantizes it into the cache. `kv_b` then reads it as is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.fp4_site is None else self.fp4_site.quantize_input(y)
