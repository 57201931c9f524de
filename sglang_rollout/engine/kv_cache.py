"""Paged KV cache: fixed-size blocks of token slots, shared between sequences by reference count.

fp4: K and V of each (token, KV head) row are stored as packed E2M1 codes, E4M3 block scales and
one FP32 global scale (docs/design.md section 3), in parallel tensors indexed by the same slot.
bf16: plain BF16 rows. Shapes (per layer): codes [slots, kv_heads, d/2], scales [slots, kv_heads,
d/16], g [slots, kv_heads, 1]; slot = block * block_size + offset.

Multi-head latent attention (DeepSeek-V3, docs/design.md section 3.1) caches one row per token
instead: `k` holds the compressed KV latent [slots, 1, kv_lora_rank] (FP4 in fp4, as above) and
`v` the decoupled RoPE key [slots, 1, qk_rope_head_dim], always BF16.
"""

from __future__ import annotations

import torch

from trace_kernels.fp4 import QTensor, quantize
from trace_kernels.fp4.paged_attention import read_cache_rows


class BlockAllocator:
    """Free list and reference counts of KV-cache blocks."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, each with one reference; MemoryError when fewer are free."""
        if n > len(self.free):
            raise MemoryError(f"KV cache full: {n} blocks needed, {len(self.free)} free")
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of `blocks` (a fork shares a prompt's full blocks)."""
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; a block with none left is free again."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    @property
    def num_free(self) -> int:
        return len(self.free)


class PagedKVCache:
    """K and V of every layer for `num_blocks * block_size` token slots."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 fp4: bool, device: str, *, v_head_dim: int | None = None, v_fp4: bool | None = None):
        self.block_size, self.fp4 = block_size, fp4
        slots = num_blocks * block_size
        self.allocator = BlockAllocator(num_blocks)
        dev = torch.device(device)

        def layer(d, packed):
            if packed:
                return {"codes": torch.zeros(slots, kv_heads, d // 2, dtype=torch.uint8, device=dev),
                        "scales": torch.zeros(slots, kv_heads, d // 16, dtype=torch.uint8, device=dev),
                        "g": torch.ones(slots, kv_heads, 1, dtype=torch.float32, device=dev)}
            return {"rows": torch.zeros(slots, kv_heads, d, dtype=torch.bfloat16, device=dev)}
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        v_fp4 = fp4 if v_fp4 is None else v_fp4
        self.k = [layer(head_dim, fp4) for _ in range(num_layers)]
        self.v = [layer(v_head_dim, v_fp4) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model_cfg, num_blocks: int, block_size: int, fp4: bool, device: str) -> PagedKVCache:
        """The cache of a model (megatron_trace.model_config.ModelConfig): K and V per KV head,
        or under MLA the latent (`k`) and the RoPE key (`v`, BF16)."""
        c = model_cfg
        if c.mla:
            return cls(c.num_layers, num_blocks, block_size, 1, c.kv_lora_rank, fp4, device,
                       v_head_dim=c.qk_rope_head_dim, v_fp4=False)
        return cls(c.num_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim, fp4, device)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of token positions [start, end) of a sequence with this block table."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k_q: QTensor | torch.Tensor, v_q: QTensor | torch.Tensor) -> None:
        """Store rows [n, kv_heads, d] (QTensors row-scaled per (token, head) in fp4) at `slots`."""
        slots = slots.to(self.k[layer][next(iter(self.k[layer]))].device)
        for cache, t in ((self.k[layer], k_q), (self.v[layer], v_q)):
            if "codes" in cache:
                cache["codes"][slots] = t.codes
                cache["scales"][slots] = t.block_scales.view(torch.uint8)
                cache["g"][slots] = t.global_scale
            else:
                cache["rows"][slots] = t

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """BF16 K and V [n, kv_heads, d] at `slots` (dequantized in fp4)."""
        k, v = self.k[layer], self.v[layer]
        s = slots.to(next(iter(k.values())).device)
        return read_cache_rows(k, s), read_cache_rows(v, s)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first n token slots of block src into block dst, every layer (copy on fork)."""
        bs = self.block_size
        a, b = torch.arange(src * bs, src * bs + n), torch.arange(dst * bs, dst * bs + n)
        for cache in self.k + self.v:
            for t in cache.values():
                t[b.to(t.device)] = t[a.to(t.device)]

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> QTensor:
        """FP4 of K or V rows [n, kv_heads, d]: one global scale per (token, head)."""
        return quantize(x, "nvfp4", scale="row", check_finite=False)

    def nbytes_per_token(self) -> int:
        """Bytes of K and V of one token slot, all layers."""
        return sum(t[0].numel() * t.element_size() for cache in self.k + self.v for t in cache.values())
