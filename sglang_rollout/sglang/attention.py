"""SGLang attention over TRACE's NVFP4 KV cache (attention backend "trace_fp4").

Decode runs trace_kernels' paged FP4 attention (`paged_decode_attention`: on a GPU the kernels
the built-in engine runs, which dequantize K and V tiles in registers to the trainer's BF16
values; on the CPU its torch reference). SGLang's pool is paged by its page size P, so a
sequence's block table is every P-th slot of its row of req_to_token, divided by P. Extend
(prefill, and the feed of a finished sample) dequantizes each request's cached rows, the new
ones included (what was just stored, so what decode reads too), and runs torch's SDPA with the
causal mask shifted by the cached prefix. Under CUDA graphs the decode block tables and lengths
live in buffers of a fixed address, refilled before each replay.

Shapes: T tokens of the forward, B requests, Hq / Hkv this rank's query / KV heads, D head dim.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from trace_kernels.fp4.paged_attention import cached_causal_attention, paged_decode_attention, read_cache_rows

from .quant import kernel_backend

NAME = "trace_fp4"


class TraceFP4AttnBackend(AttentionBackend):
    """Attention that reads `kv_cache.TraceNVFP4KVMethod`'s pool (see the module docstring)."""

    def __init__(self, runner):
        super().__init__()
        self.pool, self.req_to_token = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
        # SGLang's forward context reads the pools off the backend
        self.token_to_kv_pool, self.req_to_token_pool = self.pool, runner.req_to_token_pool
        self.method = getattr(self.pool, "quant_method", None)
        # TRACE's FP4 MLA latent (mla.TraceNVFP4MLAPool) is read by TRACE's MLA forward, not here
        self.mla = hasattr(self.pool, "latent_cache")
        if not self.mla and not hasattr(self.method, "cache_of"):
            raise ValueError(f"attention backend {NAME!r} reads TRACE's NVFP4 KV cache: start the engine with "
                             "quantization='trace_fp4'")
        self.page = runner.page_size
        self.device = runner.device
        self.meta = None
        self.graph_tables = self.graph_lens = None

    # -- metadata -----------------------------------------------------------------------------
    def _tables(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Block tables int32 [B, max_pages]: page p of request b is its slot p * P over P."""
        return (self.req_to_token[req_pool_indices.long(), ::self.page] // self.page).to(torch.int32)

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager forwards: decode's block tables and lengths, fresh each time."""
        if forward_batch.forward_mode.is_decode_or_idle():
            self.meta = (self._tables(forward_batch.req_pool_indices), forward_batch.seq_lens.to(torch.int32))
        else:
            self.meta = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        width = self._tables(torch.zeros(1, dtype=torch.long, device=self.req_to_token.device)).shape[1]
        self.graph_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=self.device)
        self.graph_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before capturing or replaying a decode graph: its requests' tables into the fixed buffers."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise ValueError(f"attention backend {NAME!r}: CUDA graphs of {forward_batch.forward_mode} "
                             "forwards are not supported")
        bs = forward_batch.batch_size
        self.graph_tables[:bs].copy_(self._tables(forward_batch.req_pool_indices[:bs]))
        self.graph_lens[:bs].copy_(forward_batch.seq_lens[:bs])
        self.meta = (self.graph_tables[:bs], self.graph_lens[:bs])

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- attention ----------------------------------------------------------------------------
    def _caches(self, layer) -> tuple[dict, dict]:
        i = layer.layer_id - self.pool.start_layer
        return (self.method.cache_of(self.pool.k_buffer[i], self.pool.k_scale_buffer[i]),
                self.method.cache_of(self.pool.v_buffer[i], self.pool.v_scale_buffer[i]))

    def _store(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if self.mla:
            raise ValueError(f"attention backend {NAME!r}: layer {layer.layer_id} is MLA, whose attention runs in "
                             "TRACE's MLA forward (sglang_rollout.sglang.mla); an SGLang attention path reached it")
        _check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        """q [B, Hq * D] (one new token per request) -> [B, Hq * D]. On a GPU the paged kernels;
        on the CPU each request's rows through `cached_causal_attention`, as the built-in engine."""
        self._store(layer, forward_batch, k, v, save_kv_cache)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if not q_.is_cuda:
            return self._per_request(q_, layer, forward_batch)
        tables, lens = self.meta
        kc, vc = self._caches(layer)
        out = paged_decode_attention(q_.contiguous(), kc, vc, tables, lens, self.page, scale=layer.scaling,
                                     backend=kernel_backend(q_))
        return out.reshape(q_.shape[0], -1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        """q [T, Hq * D] (each request's new tokens, after its cached prefix) -> [T, Hq * D]."""
        self._store(layer, forward_batch, k, v, save_kv_cache)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return self._per_request(q_, layer, forward_batch)

    def _per_request(self, q_, layer, forward_batch) -> torch.Tensor:
        """Each request's new queries over its dequantized cached rows (the new ones included):
        `cached_causal_attention`, the built-in engine's. q_ [T, Hq, D] -> [T, Hq * D]."""
        kc, vc = self._caches(layer)
        out = torch.empty_like(q_)
        for b, start, prefix, new in request_spans(forward_batch):
            slots = self.req_to_token[forward_batch.req_pool_indices[b], :prefix + new].long()
            keys, values = (read_cache_rows(c, slots, kernel_backend(q_)) for c in (kc, vc))
            out[start:start + new] = cached_causal_attention(q_[start:start + new], keys, values, prefix)
        return out.reshape(q_.shape[0], -1)

    def support_triton(self) -> bool:
        return False


def request_spans(forward_batch):
    """(request b, its first row in the forward, cached prefix length, new tokens) for each
    request of an extend or decode forward, in row order (host lists: no device sync)."""
    if forward_batch.forward_mode.is_decode_or_idle():
        lens = forward_batch.seq_lens_cpu.tolist()
        prefixes, news = [n - 1 for n in lens], [1] * len(lens)
    else:
        prefixes, news = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    start = 0
    for b, (prefix, new) in enumerate(zip(prefixes, news, strict=True)):
        yield b, start, prefix, new
        start += new


def _check_layer(layer) -> None:
    """ValueError for attention this backend does not compute (it would be silently wrong)."""
    window = getattr(layer, "sliding_window_size", None)
    if layer.is_cross_attention or (window is not None and window > -1) or getattr(layer, "logit_cap", 0) > 0 \
            or layer.qk_head_dim != layer.v_head_dim or abs(layer.scaling * layer.qk_head_dim ** 0.5 - 1) > 1e-6:
        raise ValueError(f"attention backend {NAME!r}: layer {layer.layer_id} needs cross attention, a sliding "
                         "window, a logit cap, another V head dim or a scale other than 1/sqrt(head dim), "
                         "which it does not compute")


def create(runner) -> TraceFP4AttnBackend:
    """SGLang's attention registry entry."""
    return TraceFP4AttnBackend(runner)
