"""Core attention on `scaled_dot_product_attention` with the FP4 KV cache's quantization, and
the rotary embedding.

The engine stores K (after RoPE) and V in its KV cache as NVFP4 with one global scale per
(token, KV head); attention then runs on the dequantized values. The trainer does the same
here: fake-quantize K and V per (token, KV head) row, then causal attention in high precision.
Packed variable-length sequences (THD, `PackedSeqParams.cu_seqlens_q`) attend only within
their own sequence.

RoPE is applied here (the model is built with position_embedding_type="none" and hands this
module its RotaryEmbedding as `rope`): Megatron's own THD path applies it one packed sequence at
a time, ~20 kernels and autograd nodes per sequence and layer, which made an SFT step of 128
short sequences of a 12-layer model take 2.3 s on an H200 for 0.2 s of GPU work
(bench/results/sft_step_2026-12-01_h200.md). Here each token's frequencies are gathered by its
position in its sequence and one call of Megatron's `apply_rotary_pos_emb` rotates the whole
pack: the same elementwise arithmetic, so the same values.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from trace_kernels.norm_rope import rope_rows

from ..packed_attention import causal_sdpa, packed_causal_attention, packed_positions
from .qat import FP4Site


def host_cu_seqlens(packed_seq_params: PackedSeqParams) -> list[int]:
    """cu_seqlens_q of THD-packed sequences as a host list, copied once per PackedSeqParams (every
    attention layer of a forward gets the same object, and each copy of a GPU tensor to the host
    waits for the GPU's queue to drain). Raises NotImplementedError unless cu_seqlens_kv equals it."""
    psp = packed_seq_params
    cached = psp.__dict__.get("_trace_host_cu")
    if cached is not None and cached[0] is psp.cu_seqlens_q and cached[1] is psp.cu_seqlens_kv:
        return cached[2]
    cu = psp.cu_seqlens_q.tolist()
    kv = psp.cu_seqlens_kv
    if kv is not None and kv is not psp.cu_seqlens_q and kv.tolist() != cu:
        raise NotImplementedError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
    psp.__dict__["_trace_host_cu"] = (psp.cu_seqlens_q, kv, cu)
    return cu


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_rows(x, cos, sin, backend="triton")

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rope_rows(grad.contiguous(), cos, sin, transpose=True, backend="triton"), None, None


def rotate_pair(query: torch.Tensor, key: torch.Tensor, freqs: torch.Tensor, config, *, backend: str = "auto"):
    """Megatron's `apply_rotary_pos_emb(t, freqs, config)` of query and key [S, ..., d] with freqs
    float32 [S, 1, 1, d] (row s of the leading dim at freqs[s]): the rotated pair. BF16 on a GPU (or
    backend="triton": the CPU interpreter, for tests) runs `rope_rows`, one kernel each way and the
    same bits, its cos / sin computed once for both (Megatron's unfused path makes about five
    elementwise passes each way per tensor); Megatron's own function otherwise (its TE fusion,
    interleaved or partial rotary, other dtypes)."""
    fused = backend == "triton" or (backend == "auto" and query.is_cuda)
    if (fused and query.dtype == key.dtype == torch.bfloat16 and not config.apply_rope_fusion
            and not config.rotary_interleaved and not config.multi_latent_attention
            and freqs.shape[-1] == query.shape[-1]):
        n, d = freqs.shape[0], freqs.shape[-1]
        # Megatron's (cos(freqs) * 1.0).to(bf16): the product by mscale 1.0 is exact
        cos, sin = (f(freqs).reshape(n, d).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        return _Rope.apply(query, cos, sin), _Rope.apply(key, cos, sin)
    squeeze = query.dim() == 3  # THD [T, h, d]: Megatron's bshd path wants a batch dim
    rotated = (apply_rotary_pos_emb(t.unsqueeze(1) if squeeze else t, freqs, config) for t in (query, key))
    return tuple(t.squeeze(1) if squeeze else t for t in rotated)


class FP4CoreAttention(DotProductAttention):
    """Causal GQA attention; K and V pass through their FP4 sites (`k_site`, `v_site`).

    Inputs as Megatron's core attention: query [S, B, heads, d] and key/value
    [S, B, kv_heads, d] (or [T, heads, d] / [T, kv_heads, d] for THD-packed sequences).
    Returns [S, B, heads * d] (or [T, heads * d]) in the query's dtype.
    """

    k_site: FP4Site | None = None
    v_site: FP4Site | None = None
    caches_kv: bool = True  # False under MLA: the engine caches the latent (its own site), not K and V

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        # MLA passes its head widths (as to Transformer Engine's attention); they are the inputs'
        # last dimensions here, and MLA passes its softmax scale with them
        super().__init__(*args, **kwargs)
        self.rope: torch.nn.Module | None = None  # Megatron's RotaryEmbedding (build_model sets it); None: no RoPE

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal) or attention_bias is not None:
            raise NotImplementedError(f"FP4CoreAttention is causal self-attention only (got {mask_type}, "
                                      f"attention_bias={'set' if attention_bias is not None else None})")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cu = host_cu_seqlens(packed_seq_params) if thd else None
        if self.rope is not None:
            query, key = self._rotate(query, key, cu)
        if self.k_site is not None:  # the engine caches K after RoPE
            key = self.k_site.quantize_input(key)
            value = self.v_site.quantize_input(value)
        if not thd:  # [S, B, h, d] -> [B, h, S, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = causal_sdpa(q, k, v, self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
        return self._packed(query, key, value, cu)

    def _rotate(self, query, key, cu: list[int] | None):
        """query, key with RoPE at each token's position in its sequence: [S, B, h, d] (position =
        index along S) or THD [T, h, d] (position from the start of its packed sequence; tokens
        after the last sequence get position 0, they attend to nothing)."""
        if cu is None:
            return rotate_pair(query, key, self.rope(query.shape[0]), self.config)  # freqs [S, 1, 1, d] float32
        pos = packed_positions(tuple(cu), query.shape[0], query.device)
        longest = max((hi - lo for lo, hi in pairwise(cu)), default=1)
        return rotate_pair(query, key, self.rope(max(longest, 1))[pos], self.config)  # freqs [T, 1, 1, d]

    def _packed(self, query, key, value, cu: list[int]):
        return packed_causal_attention(query, key, value, cu, self.softmax_scale)

