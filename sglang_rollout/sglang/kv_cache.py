"""TRACE's NVFP4 KV cache inside SGLang's KV pool: K (after RoPE) and V of every (token, KV head)
row as packed E2M1 codes, E4M3 block scales and one FP32 global scale of its own (docs/design.md
section 3), exactly the trainer's K/V fake quant. SGLang's own `nvfp4` / `fp4_e2m1` KV caches
use other scales (a static per-layer global scale; power-of-two block scales), so TRACE brings
this method through SGLang's KV-cache quantization interface (`KVCacheQuantMethodBase`).

Per layer, for S slots, G KV heads (this rank's), D head dim: codes uint8 [S, G, D/2] (the pool's
k_buffer / v_buffer), block-scale bytes uint8 [S, G, D/16] (the pool's scale buffers) and global
scales float32 [S, G] (held by this method beside them: SGLang's pool knows two buffers per
layer and side; `global_scales` finds the third), the layout trace_kernels' paged attention
reads (`cache_of`). SGLang's torch_native attention may read it too: `dequantize_kv_tensor`
returns a view that dequantizes the rows it is indexed with.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import KVCacheQuantMethodBase

from trace_kernels.fp4 import quantize
from trace_kernels.fp4.paged_attention import read_cache_rows

from . import capture


class TraceNVFP4KVMethod(KVCacheQuantMethodBase):
    """SGLang's KV-cache quantization method for TRACE's NVFP4 (see the module docstring)."""

    name = "trace_nvfp4"
    SCALE_BLOCK_SIZE = 16

    def __init__(self):
        self._globals: dict[int, torch.Tensor] = {}  # scale buffer's data_ptr -> its global scales [S, G]

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
        """Codes [size, G, D/2], block scales [size, G, D/16] and global scales [size, G], K and V,
        per layer."""
        if head_dim % 16:
            raise ValueError(f"trace_nvfp4 KV cache: head dim {head_dim} is not whole NVFP4 blocks of 16")

        def per_layer(width, dtype=torch.uint8):
            return [torch.zeros(size, head_num, *width, dtype=dtype, device=device) for _ in range(layer_num)]
        out = {"k_buffer": per_layer((head_dim // 2,)), "v_buffer": per_layer((head_dim // 2,)),
               "k_scale_buffer": per_layer((head_dim // 16,)), "v_scale_buffer": per_layer((head_dim // 16,)),
               "store_dtype": torch.uint8}
        for scales in out["k_scale_buffer"] + out["v_scale_buffer"]:
            self._globals[scales.data_ptr()] = torch.ones(size, head_num, dtype=torch.float32, device=device)
        return out

    def compute_cell_size(self, head_num: int, head_dim: int, num_layers: int, kv_size: int) -> int:
        """Bytes per token slot, K and V of every layer."""
        return 2 * num_layers * head_num * (head_dim // 2 + head_dim // 16 + 4)

    def global_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """The global scales float32 [S, G] that go with one of this method's scale buffers."""
        try:
            return self._globals[scales.data_ptr()]
        except KeyError:
            raise ValueError("trace_nvfp4 KV cache: not a scale buffer of this method") from None

    def cache_of(self, codes: torch.Tensor, scales: torch.Tensor) -> dict:
        """One layer's K or V as trace_kernels' paged attention reads it: codes [S, G, D/2],
        scales [S, G, D/16] (E4M3 bytes), g float32 [S, G, 1]."""
        return {"codes": codes, "scales": scales, "g": self.global_scales(scales)[..., None]}

    def quantize_and_store(self, k_buffer, v_buffer, k_scale_buffer, v_scale_buffer, loc, cache_k, cache_v,
                           k_scale=None, v_scale=None) -> None:
        """Quantize K and V rows [T, G, D] (one global scale per (token, head)) into the slots `loc`."""
        for codes, scales, rows, site in ((k_buffer, k_scale_buffer, cache_k, "k"),
                                          (v_buffer, v_scale_buffer, cache_v, "v")):
            q = quantize(rows, "nvfp4", scale="row", check_finite=False)
            codes[loc] = q.codes
            scales[loc] = q.block_scales.view(torch.uint8)
            self.global_scales(scales)[loc] = q.global_scale.reshape(rows.shape[:-1])
            layer = capture.current_layer()
            if layer is not None and capture.wants(layer, site):
                capture.record(layer, site, rows.reshape(-1, rows.shape[-1]), q.rounding())

    def dequantize_kv_tensor(self, fp4_tensor, scales, layer_id: int, dtype=None):
        """The layer's K or V as rows to index: `view[slots]` -> BF16 [n, G, D]."""
        return DequantizedRows(self.cache_of(fp4_tensor, scales), dtype or torch.bfloat16)

    def dequantize_prev_kv(self, k_fp4, k_scales, v_fp4, v_scales, layer_id: int):
        return (self.dequantize_kv_tensor(k_fp4, k_scales, layer_id)[...],
                self.dequantize_kv_tensor(v_fp4, v_scales, layer_id)[...])


class DequantizedRows:
    """A layer's stored K or V (`TraceNVFP4KVMethod.cache_of`) that dequantizes only the slots it
    is indexed with: rows[slots] -> [n, G, D] in `dtype` (what paged attention reads)."""

    def __init__(self, cache: dict, dtype=torch.bfloat16):
        self.cache, self.dtype = cache, dtype
        codes = cache["codes"]
        self.shape = torch.Size((*codes.shape[:-1], 2 * codes.shape[-1]))
        self.device = codes.device

    def __getitem__(self, index) -> torch.Tensor:
        return read_cache_rows(self.cache, index).to(self.dtype)
