"""TRACE's multi-head latent attention in SGLang's DeepSeek model (DeepSeek-V3 family).

None of SGLang's MLA paths computes the trainer's MLA: its MHA prefill up-projects the unquantized
latent, its absorbed decode folds `kv_b` into w_kc / w_vc (other roundings), and both write the
latent through SGLang's own store (docs/notes/sglang-deepseek.md). So each `DeepseekV2AttentionMLA`
gets the built-in engine's arithmetic (`sglang_rollout.engine.model.ModelRunner._mla`), on SGLang's
own linears (their quant methods are `trace_fp4`'s), norms (`numerics`) and KV pool:

    q  = q_b(q_a_norm(q_a(x)))  or  q_proj(x)        x: the input_layernorm's output [T, H]
    latent, k_pe = kv_a(x);  latent = kv_a_norm(latent)
    q_pe, k_pe: de-interleaved, then RoPE (YaRN tables and scale from TRACE's ModelConfig)
    the pool stores the latent (NVFP4 rows in fp4: `TraceNVFP4MLAPool`) and k_pe (BF16)
    per request: k_nope, v = kv_b(its cached latents as stored); SDPA over [k_nope | k_pe]

The latent is quantized once, when stored; kv_b reads the dequantized rows (its input is not
quantized again: the `kv_up` site is weight-only). Each request's slots come from SGLang's
req_to_token, so the radix cache's shared prefixes are read as the built-in engine reads its
pages. Not CUDA-graph safe (per-request host loops): `config.server_args` turns graphs off.

Shapes: T tokens of the forward, h this rank's heads, R kv_lora_rank, r qk_rope_head_dim,
n nope (qk_nope_head_dim), v v_head_dim.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from sglang_rollout.engine.kv_cache import PagedKVCache
from sglang_rollout.engine.rope import ModelRope
from trace_kernels.fp4.paged_attention import cached_causal_attention, read_cache_rows
from trace_kernels.norm_rope import deinterleave, rope

from . import capture
from .attention import request_spans
from .quant import kernel_backend


class TraceNVFP4MLAPool(MLATokenToKVPool):
    """SGLang's MLA KV pool holding TRACE's FP4 latent: per layer codes uint8 [S, 1, R/2], E4M3
    block scales uint8 [S, 1, R/16], one global scale per token float32 [S, 1, 1] (the built-in
    engine's `PagedKVCache` MLA layout) and the RoPE key BF16 [S, 1, r]. Read and written by
    `mla_forward` only (`write` / `read`); SGLang's row accessors, which would hand out or take
    BF16 latent rows, refuse."""

    def _create_buffers(self) -> None:
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        r, rot, n = self.kv_lora_rank, self.qk_rope_head_dim, self.size + self.page_size
        if r % 16:
            raise ValueError(f"trace_fp4 MLA KV cache: kv_lora_rank {r} is not whole NVFP4 blocks of 16")

        def per_layer(width, dtype):
            return [torch.zeros(n, 1, width, dtype=dtype, device=self.device) for _ in range(self.layer_num)]
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.kv_buffer = per_layer(r // 2, torch.uint8)  # SGLang's data_ptrs are taken from these
            self.scale_buffer = per_layer(r // 16, torch.uint8)
            self.g_buffer = per_layer(1, torch.float32)
            self.rope_buffer = per_layer(rot, torch.bfloat16)

    def _clear_buffers(self) -> None:
        del self.kv_buffer, self.scale_buffer, self.g_buffer, self.rope_buffer

    def _buffers(self):
        return self.kv_buffer + self.scale_buffer + self.g_buffer + self.rope_buffer

    def get_kv_size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers())

    @staticmethod
    def cell_bytes(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
        """Bytes of one token slot of one layer: codes, block scales, global scale, RoPE key."""
        return kv_lora_rank // 2 + kv_lora_rank // 16 + 4 + 2 * qk_rope_head_dim

    def latent_cache(self, i: int) -> dict:
        """Layer i's (this pool's index) latent as trace_kernels reads a paged FP4 cache."""
        return {"codes": self.kv_buffer[i], "scales": self.scale_buffer[i], "g": self.g_buffer[i]}

    def write(self, i: int, loc: torch.Tensor, latent_q, k_pe: torch.Tensor) -> None:
        """Store the quantized latents (QTensor [T, 1, R], row-scaled) and RoPE keys [T, 1, r] at slots `loc`."""
        self.kv_buffer[i][loc] = latent_q.codes
        self.scale_buffer[i][loc] = latent_q.block_scales.view(torch.uint8)
        self.g_buffer[i][loc] = latent_q.global_scale
        self.rope_buffer[i][loc] = k_pe.to(torch.bfloat16)

    def read(self, i: int, slots: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """(latents BF16 [n, R] dequantized, RoPE keys BF16 [n, 1, r]) at `slots`."""
        return read_cache_rows(self.latent_cache(i), slots, backend)[:, 0], self.rope_buffer[i][slots]

    def _refuse(self, *args, **kwargs):
        raise ValueError("trace_fp4 MLA KV cache: it holds NVFP4 latents that only TRACE's MLA forward reads and "
                         "writes (sglang_rollout.sglang.mla); an SGLang path asked for its BF16 rows")

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _refuse
    set_mla_kv_buffer = get_mla_kv_buffer = get_cpu_copy = load_cpu_copy = _refuse

    def get_contiguous_buf_infos(self):
        raise ValueError("trace_fp4 MLA KV cache: disaggregated KV transfer of TRACE's FP4 latent is not supported")

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        for t in self._buffers():
            t[tgt_loc] = t[src_loc]


def _store(pool, i: int, loc: torch.Tensor, latent_TR: torch.Tensor, k_pe_T1r: torch.Tensor):
    """Write a forward's latents and RoPE keys; what the cache holds of the latent (a QTensor in
    fp4, else the BF16 rows), for guidance."""
    if isinstance(pool, TraceNVFP4MLAPool):
        lat_q = PagedKVCache.quantize_rows(latent_TR[:, None])
        pool.write(i, loc, lat_q, k_pe_T1r)
        return lat_q
    pool.kv_buffer[i][loc] = torch.cat([latent_TR[:, None], k_pe_T1r], -1).to(pool.store_dtype)
    return None


def _read(pool, i: int, slots: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents [n, R], RoPE keys [n, 1, r]) BF16 at `slots`, as the cache holds them."""
    if isinstance(pool, TraceNVFP4MLAPool):
        return pool.read(i, slots, backend)
    rows = pool.kv_buffer[i][slots]
    return rows[:, 0, :pool.kv_lora_rank], rows[:, :, pool.kv_lora_rank:]


def align_attention(attn, cfg) -> None:
    """Give one `DeepseekV2AttentionMLA` TRACE's MLA forward (module docstring); cfg: TRACE's ModelConfig."""
    rope_of = ModelRope.of(cfg, attn.kv_a_layernorm.weight.device)
    if attn.q_lora_rank:
        # the q and kv down projections are one FP4 tensor (one global scale) that the built-in
        # engine runs as two GEMMs: the same split here, so the sums are the same
        attn.fused_qkv_a_proj_with_mqa.trace_row_split = (attn.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim)

    def forward(positions, hidden_states, forward_batch, zero_allocator=None, **_):
        return mla_forward(attn, cfg, rope_of, positions, hidden_states, forward_batch)

    attn.forward = forward


def mla_forward(attn, cfg, rope_of: ModelRope, positions, x_TH: torch.Tensor, forward_batch) -> torch.Tensor:
    """One MLA layer's output [T, H] (after o_proj and its TP all-reduce) of the normed input x_TH."""
    t, layer = x_TH.shape[0], attn.layer_id
    h, nope, rot, vd, r = attn.num_local_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
        cfg.kv_lora_rank
    if t == 0:
        return x_TH
    if attn.q_lora_rank:
        q_lat, latent, k_pe = attn.fused_qkv_a_proj_with_mqa(x_TH)[0].split([attn.q_lora_rank, r, rot], -1)
        q = attn.q_b_proj(attn.q_a_layernorm(q_lat))[0]
    else:
        q = attn.q_proj(x_TH)[0]
        latent, k_pe = attn.kv_a_proj_with_mqa(x_TH)[0].split([r, rot], -1)
    cos, sin = rope_of.tables(positions, x_TH.dtype)
    q_nope, q_pe = q.view(t, h, nope + rot).split([nope, rot], -1)
    q_ThD = torch.cat([q_nope, rope(deinterleave(q_pe), cos, sin)], -1)
    latent = attn.kv_a_layernorm(latent.contiguous())
    k_pe = rope(deinterleave(k_pe[:, None]), cos, sin)

    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    pool = get_token_to_kv_pool()
    i = layer - pool.start_layer
    stored = _store(pool, i, forward_batch.out_cache_loc, latent, k_pe)
    if capture.wants(layer, "kv"):
        if stored is None:
            raise ValueError("trace: guidance records FP4 rounding; this engine's MLA cache is BF16")
        capture.record(layer, "kv", latent, stored.rounding())

    backend = kernel_backend(x_TH)
    req_to_token = get_req_to_token_pool().req_to_token
    ctx = x_TH.new_empty(t, h, vd)
    for b, start, prefix, new in request_spans(forward_batch):
        slots = req_to_token[forward_batch.req_pool_indices[b], :prefix + new].long()
        lat, k_pe_ctx = _read(pool, i, slots, backend)
        kv = attn.kv_b_proj(lat)[0].view(-1, h, nope + vd)
        k_nope, values = kv.split([nope, vd], -1)
        keys = torch.cat([k_nope, k_pe_ctx.expand(-1, h, -1)], -1)
        ctx[start:start + new] = cached_causal_attention(q_ThD[start:start + new], keys, values, prefix,
                                                         rope_of.softmax_scale)
    return attn.o_proj(ctx.flatten(1))[0]
