"""Core attention on `scaled_dot_product_attention` with the FP4 KV cache's quantization.

The engine stores K (after RoPE) and V in its KV cache as NVFP4 with one global scale per
(token, KV head); attention then runs on the dequantized values. The trainer does the same
here: fake-quantize K and V per (token, KV head) row, then causal attention in high precision.
Packed variable-length sequences (THD, `PackedSeqParams.cu_seqlens_q`) attend only within
their own sequence.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .qat import FP4Site


class FP4CoreAttention(DotProductAttention):
    """Causal GQA attention; K and V pass through their FP4 sites (`k_site`, `v_site`).

    Inputs as Megatron's core attention: query [S, B, heads, d] and key/value
    [S, B, kv_heads, d] (or [T, heads, d] / [T, kv_heads, d] for THD-packed sequences).
    Returns [S, B, heads * d] (or [T, heads * d]) in the query's dtype.
    """

    k_site: FP4Site | None = None
    v_site: FP4Site | None = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal) or attention_bias is not None:
            raise NotImplementedError(f"FP4CoreAttention is causal self-attention only (got {mask_type}, "
                                      f"attention_bias={'set' if attention_bias is not None else None})")
        if self.k_site is not None:
            key = self.k_site.quantize_input(key)
            value = self.v_site.quantize_input(value)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if not thd:  # [S, B, h, d] -> [B, h, S, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._sdpa(q, k, v)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
        cu = packed_seq_params.cu_seqlens_q.tolist()
        if packed_seq_params.cu_seqlens_kv is not None and packed_seq_params.cu_seqlens_kv.tolist() != cu:
            raise NotImplementedError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        outs = []
        for lo, hi in pairwise(cu):
            q, k, v = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))
        pad = query.shape[0] - cu[-1]  # tokens after the last sequence (padding) attend to nothing
        if pad:
            outs.append(query.new_zeros(pad, *query.shape[1:]))
        return torch.cat(outs).reshape(query.shape[0], -1)

    def _sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
