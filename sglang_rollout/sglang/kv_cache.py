"""TRACE's NVFP4 KV cache inside SGLang's KV pool: K (after RoPE) and V of every (token, KV head)
row as packed E2M1 codes, E4M3 block scales and one FP32 global scale of its own (docs/design.md
section 3), exactly the trainer's K/V fake quant. SGLang's own `nvfp4` / `fp4_e2m1` KV caches
use other scales (a static per-layer global scale; power-of-two block scales), so TRACE brings
this method through SGLang's KV-cache quantization interface (`KVCacheQuantMethodBase`).

Per layer, for S slots, G KV heads (this rank's), D head dim: codes uint8 [S, G, D/2] (the pool's
k_buffer / v_buffer) and scales uint8 [S, G, D/16 + 4] (the pool's scale buffers: the E4M3
block-scale bytes, then the float32 global scale's four bytes). Attention reads dequantized
BF16 rows: `dequantize_kv_tensor` returns a view that dequantizes the rows it is indexed with
(SGLang's torch_native backend gathers each request's slots from it).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import KVCacheQuantMethodBase

from trace_kernels.fp4 import Format, QTensor, dequantize, quantize

from . import capture


class TraceNVFP4KVMethod(KVCacheQuantMethodBase):
    """SGLang's KV-cache quantization method for TRACE's NVFP4 (see the module docstring)."""

    name = "trace_nvfp4"
    SCALE_BLOCK_SIZE = 16

    def needs_plain_kv_dequant_read(self) -> bool:
        return True

    def needs_dequant_workspace(self) -> bool:
        return False

    def dequant_workspace_dtype(self):
        return None

    def kv_storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def plain_attention_kv_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def create_buffers(self, size: int, head_num: int, head_dim: int, layer_num: int, device) -> dict:
        """Codes [size, G, D/2] and scales + global scale [size, G, D/16 + 4], K and V, per layer."""
        if head_dim % 16:
            raise ValueError(f"trace_nvfp4 KV cache: head dim {head_dim} is not whole NVFP4 blocks of 16")

        def per_layer(width):
            return [torch.zeros(size, head_num, width, dtype=torch.uint8, device=device) for _ in range(layer_num)]
        return {"k_buffer": per_layer(head_dim // 2), "v_buffer": per_layer(head_dim // 2),
                "k_scale_buffer": per_layer(head_dim // 16 + 4), "v_scale_buffer": per_layer(head_dim // 16 + 4),
                "store_dtype": torch.uint8}

    def compute_cell_size(self, head_num: int, head_dim: int, num_layers: int, kv_size: int) -> int:
        """Bytes per token slot, K and V of every layer."""
        return 2 * num_layers * head_num * (head_dim // 2 + head_dim // 16 + 4)

    def quantize_and_store(self, k_buffer, v_buffer, k_scale_buffer, v_scale_buffer, loc, cache_k, cache_v,
                           k_scale=None, v_scale=None) -> None:
        """Quantize K and V rows [T, G, D] (one global scale per (token, head)) into the slots `loc`."""
        for codes, scales, rows, site in ((k_buffer, k_scale_buffer, cache_k, "k"),
                                          (v_buffer, v_scale_buffer, cache_v, "v")):
            q = quantize(rows, "nvfp4", scale="row", check_finite=False)
            g_bytes = q.global_scale.reshape(*rows.shape[:-1], 1).contiguous().view(torch.uint8)
            codes[loc] = q.codes
            scales[loc] = torch.cat([q.block_scales.view(torch.uint8), g_bytes], -1)
            layer = capture.current_layer()
            if layer is not None and capture.wants(layer, site):
                capture.record(layer, site, rows.reshape(-1, rows.shape[-1]), capture.dense_parts(q))

    def dequantize_kv_tensor(self, fp4_tensor, scales, layer_id: int, dtype=None):
        """The layer's K or V as rows to index: `view[slots]` -> BF16 [n, G, D]."""
        return DequantizedRows(fp4_tensor, scales, dtype or torch.bfloat16)

    def dequantize_prev_kv(self, k_fp4, k_scales, v_fp4, v_scales, layer_id: int):
        return (DequantizedRows(k_fp4, k_scales)[...], DequantizedRows(v_fp4, v_scales)[...])


class DequantizedRows:
    """A layer's stored K or V (codes [S, G, D/2], scales + g [S, G, D/16 + 4]) that dequantizes
    only the slots it is indexed with: rows[slots] -> [n, G, D] in `dtype`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        self.codes, self.scales, self.dtype = codes, scales, dtype
        self.shape = torch.Size((*codes.shape[:-1], 2 * codes.shape[-1]))
        self.device = codes.device

    def __getitem__(self, index) -> torch.Tensor:
        codes, packed = self.codes[index], self.scales[index]
        d = 2 * codes.shape[-1]
        g = packed[..., d // 16:].contiguous().view(torch.float32)
        q = QTensor(codes, packed[..., :d // 16].contiguous().view(torch.float8_e4m3fn), g, Format.NVFP4,
                    torch.Size((*codes.shape[:-1], d)))
        return dequantize(q, self.dtype)
