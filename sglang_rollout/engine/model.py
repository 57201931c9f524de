"""One forward of the Qwen3-MoE model over a batch of segments (prefill chunks and decodes).

Shapes: N new tokens packed over all segments, H hidden, d head dim, k top-k. The arithmetic
follows the trainer's (megatron_trace.megatron): fused QKV with query groups interleaved, QK
RMSNorm then RoPE (non-interleaved halves), fp32 router with softmax over the top-k logits, the
gate weight on each expert's fc2 output, BF16 residual stream. In fp4 precision every FP4 site
quantizes its input rows with one global scale per row (K and V per (token, KV head), as
stored in the paged cache) and runs on the dequantized values (Hopper has no FP4 tensor cores);
weights stay packed and are dequantized for the matmul.

When asked, the pre-quantization rows of the FP4 sites are returned in guidance order, so the
engine can record how it rounded (megatron_trace.guidance.capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from trace_kernels.fp4 import QTensor, fake_quantize_rows, mantissa_bits
from trace_kernels.fp4.linear import (
    expert_tiles,
    fp4_grouped_linear,
    fp4_linear_parts,
    sum_parts,
)
from trace_kernels.fp4.paged_attention import paged_decode_attention
from trace_kernels.fused_inputs import (
    add_rms_norm_fake_quantize_rows,
    rms_norm_fake_quantize_rows,
    silu_mul,
    silu_mul_fake_quantize_rows,
)
from trace_kernels.moe_routing import combine_experts, expert_order, route
from trace_kernels.norm_rope import qk_norm_rope, qk_norm_rope_into_cache, rms_norm

from megatron_trace.model_config import ModelConfig

from .kv_cache import PagedKVCache
from .weights import EngineWeights


@dataclass
class Segment:
    """New tokens of one sequence in this forward: positions start .. start + len(token_ids)."""

    token_ids: list[int]
    start: int
    block_table: list[int]


def map_rows(fn, captured):
    """fn applied to a captured site's rows [R, ...], or to each part of its (bits, scales, g)."""
    return tuple(fn(t) for t in captured) if isinstance(captured, tuple) else fn(captured)


def _dense_capture(q: QTensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mantissa bits [R, k/8], scale bytes [R, k/16], g [R]) of row-scaled FP4 rows of length k."""
    return (mantissa_bits(q.codes.reshape(-1, k // 2)), q.block_scales.view(torch.uint8).reshape(-1, k // 16),
            q.global_scale.reshape(-1))


class _Batch:
    """Index tensors of one forward, built once: token ids, positions, cache slots [N], and for
    decode-only batches the block tables [B, max_blocks] and sequence lengths [B]."""

    def __init__(self, segments: list[Segment], block_size: int, dev):
        self.segments = segments
        lengths = [len(s.token_ids) for s in segments]
        width = max(len(s.block_table) for s in segments)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in segments],
                              dtype=torch.int32)
        seg_of = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(lengths))
        starts = torch.tensor([s.start for s in segments])
        first = torch.tensor([0] + lengths[:-1]).cumsum(0)
        pos = starts[seg_of] + torch.arange(len(seg_of)) - first[seg_of]
        self.ids = torch.tensor([t for s in segments for t in s.token_ids], device=dev)
        self.pos = pos.to(dev)
        self.slots = (tables[seg_of, pos // block_size].long() * block_size + pos % block_size).to(dev)
        self.decode_only = len(seg_of) == len(segments)
        self.tables = tables.to(dev)
        self.lens = (starts + torch.tensor(lengths)).to(torch.int32).to(dev)
        self.last = None if self.decode_only else (torch.tensor(lengths).cumsum(0) - 1).to(dev)


class ModelRunner:
    """kernels: "torch" (dequantize whole weights, gather and dequantize KV rows, SDPA, torch's
    norms and routing) or "triton" (FP4 GEMMs that dequantize in registers; decode-only batches
    read the FP4 KV cache in the paged attention kernel; trace_kernels' norm, RoPE and MoE
    routing kernels). "auto" on CUDA: "triton", except the FP4 decode attention and the
    decode-sized FP4 GEMMs, which run trace_kernels.fp4.cuda_decode's CUDA C++ kernels where
    they apply (Hopper; head dim 128; K a multiple of 128)."""

    def __init__(self, cfg: ModelConfig, weights: EngineWeights, cache: PagedKVCache, fp4: bool,
                 kernels: str = "auto"):
        self.cfg, self.w, self.cache, self.fp4 = cfg, weights, cache, fp4
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.backend = kernels
        d = cfg.head_dim
        self.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(weights.device)

    def _site(self, rows, layer, name, x, codes=False):
        """Fake-quantize an FP4 site's input rows (fp4) and, when the layer is captured, keep the
        rows, or with `codes` what the quantize kernel kept of their rounding."""
        x2 = x.reshape(-1, x.shape[-1])
        if not self.fp4:
            if rows is not None:
                rows[(layer, name)] = x2
            return x
        xq, kept = fake_quantize_rows(x2, capture=rows is not None and codes, backend=self.backend)
        if rows is not None:
            rows[(layer, name)] = x2 if kept is None else kept
        return xq.view_as(x)

    def _norm_site(self, rows, layer, name, x, weight, codes=False, product=None):
        """(the FP4 site's input: rms_norm(x) fake-quantized in fp4, the norm's rows, x), where
        with a `product` (`_linear`'s) x is first made x + product, the residual stream after a
        block. In one kernel on the GPU in fp4 (not where captured rows must be the unquantized
        ones)."""
        eps = self.cfg.rms_norm_eps
        if self.fp4 and (rows is None or codes):
            capture = rows is not None
            if product is None:
                xq, h, kept = rms_norm_fake_quantize_rows(x, weight, eps, capture=capture, backend=self.backend)
            else:
                xq, h, kept, x = add_rms_norm_fake_quantize_rows(product, x, weight, eps, capture=capture,
                                                                 backend=self.backend)
            if rows is not None:
                rows[(layer, name)] = kept
            return xq, h, x
        if product is not None:
            x = sum_parts(product, x)
        h = rms_norm(x, weight, eps, backend=self.backend)
        return self._site(rows, layer, name, h, codes), h, x

    def _swiglu_site(self, rows, layer, gate_up, codes=False):
        """fc2's input: silu(gate) * up of gate_up [R, 2I], fake-quantized in fp4 (one kernel on
        the GPU, as `_norm_site`); its captured rows go to `rows` (in the rows' own order)."""
        if self.fp4 and (rows is None or codes):
            xq, _, kept = silu_mul_fake_quantize_rows(gate_up, capture=rows is not None, backend=self.backend)
            if rows is not None:
                rows[(layer, "fc2")] = kept
            return xq
        return self._site(rows, layer, "fc2", silu_mul(gate_up, backend=self.backend), codes)

    def _linear(self, x, name):
        """x [n, K] @ W^T for an FP4-site weight (packed in fp4 precision), as `fp4_linear_parts`
        leaves it: bf16 [n, N], or on the GPU FP32 partial products [S, n, N] that the next
        kernel adds up (`sum_parts`)."""
        if self.fp4:
            return fp4_linear_parts(x, self.w.tensors[name], backend=self.backend)
        return x @ self.w.dense(name).T

    def _rope_tables(self, pos, dtype):
        """cos, sin [N, 1, d] in the activations' dtype (like Megatron's bshd path), for the rotary:
        the same for q and k and every layer, so computed once per forward."""
        freqs = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], -1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def forward(self, segments: list[Segment], capture_layers=frozenset(), all_logits: bool = False,
                codes: bool = False, ids: torch.Tensor | None = None):
        """Run the segments; write their K/V into the cache. `ids` (int64 [N] on the model's
        device), if given, are the new tokens in place of the segments' token_ids: tokens a
        previous step drew and the host has not seen yet.

        Returns:
            logits float32 [len(segments), V] (each segment's last token) or [N, V] (all_logits),
            captured site rows {(layer, site): [R, K]} for `capture_layers` (R = N, or N * kv_heads
            for k/v, N * top_k for fc2; with `codes` (fp4): (mantissa bits uint8 [R, K/8], block
            scale bytes uint8 [R, K/16], g float32 [R]) from the fused quantize kernel instead),
            routed experts {layer: int64 [N, top_k]}.
        """
        batch = _Batch(segments, self.cache.block_size, self.w.device)  # index tensors built once per forward
        if ids is not None:
            if ids.shape != batch.ids.shape:
                raise ValueError(f"forward: ids {tuple(ids.shape)} for {batch.ids.numel()} new tokens")
            batch.ids = ids
        return self.forward_batch(batch, capture_layers, all_logits, codes)

    def forward_batch(self, batch, capture_layers=frozenset(), all_logits: bool = False, codes: bool = False):
        """`forward` on prebuilt index tensors (`_Batch` or the static buffers of a `DecodeGraph`).
        Decode-only batches run without host synchronisation, so they can be graph-captured."""
        cfg, w = self.cfg, self.w
        nq, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ids, pos = batch.ids, batch.pos
        n = ids.numel()
        captured, routed = {}, {}
        x = w.dense("embedding.word_embeddings.weight")[ids]
        cos, sin = self._rope_tables(pos, x.dtype)
        for L in range(cfg.num_layers):
            p = f"decoder.layers.{L}."
            rows = captured if L in capture_layers else None
            qkv_in, _, _ = self._norm_site(rows, L, "qkv", x, w.dense(p + "input_layernorm.weight"), codes)
            qkv = self._linear(qkv_in, p + "self_attention.linear_qkv.weight")
            qkv = qkv.view(*qkv.shape[:-1], ng, nq // ng + 2, d)
            qk_norm = (w.dense(p + "self_attention.q_layernorm.weight"), w.dense(p + "self_attention.k_layernorm.weight"),
                       cfg.rms_norm_eps, cos, sin)
            if rows is not None:  # captured: with codes, the rounding the cache itself holds
                qkv = sum_parts(qkv)
                q, kk = qk_norm_rope(qkv, *qk_norm, backend=self.backend)
                v = qkv[:, :, -1]
                kq, vq = (PagedKVCache.quantize_rows(kk), PagedKVCache.quantize_rows(v)) if self.fp4 else (kk, v)
                rows[(L, "k")], rows[(L, "v")] = ((_dense_capture(kq, d), _dense_capture(vq, d)) if codes and self.fp4
                                                  else (kk.reshape(-1, d), v.reshape(-1, d)))
                self.cache.write(L, batch.slots, kq, vq)
            else:  # K and V go into the cache from the norm + RoPE kernel
                q = qk_norm_rope_into_cache(qkv, *qk_norm, self.cache.k[L], self.cache.v[L], batch.slots,
                                            backend=self.backend)
            ctx = self._attention(L, batch, q)
            ctx = ctx.reshape(n, nq * d)
            proj = self._linear(self._site(rows, L, "proj", ctx, codes), p + "self_attention.linear_proj.weight")
            x = self._moe(L, p, x, proj, rows, routed, codes)
        x = rms_norm(x, w.dense("decoder.final_layernorm.weight"), cfg.rms_norm_eps, backend=self.backend)
        if not all_logits and batch.last is not None:
            x = x[batch.last]
        return (x @ w.dense("output_layer.weight").T).float(), captured, routed

    def _attention(self, L, batch, q):
        """Attend over each sequence's cache (the segments' own K/V already written)."""
        n, nq, d = q.shape
        if batch.decode_only and self.backend != "torch" and (self.backend == "triton" or q.is_cuda):
            # "auto" on a GPU: the CUDA C++ kernel where it applies (FP4 cache, Hopper, head dim 128), else Triton
            return paged_decode_attention(q, self.cache.k[L], self.cache.v[L], batch.tables, batch.lens,
                                          self.cache.block_size, backend="auto" if self.backend == "auto" else "triton")
        ctx = torch.empty(n, nq, d, dtype=q.dtype, device=q.device)
        offset = 0
        for seg in batch.segments:
            m = len(seg.token_ids)
            keys, values = self.cache.read(L, self.cache.slots(seg.block_table, 0, seg.start + m))
            ctx[offset:offset + m] = self._attend(q[offset:offset + m], keys, values, seg.start)
            offset += m
        return ctx

    def _attend(self, q, keys, values, start):
        """Queries at positions start.. over the cached keys 0..start+m-1, causal, GQA."""
        m, nq, _ = q.shape
        allowed = torch.arange(keys.shape[0], device=q.device)[None] <= (start + torch.arange(m, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=allowed, enable_gqa=keys.shape[1] != nq)
        return out.transpose(0, 1)

    def _experts(self, x, L, site, counts, tiles=None, x_rows=None):
        """Rows of x grouped by expert (counts per expert) through the layer's fc1 or fc2; tiles:
        the GPU kernels' row tiles of these counts (`expert_tiles`), shared by fc1 and fc2. x_rows:
        the rows are x[x_rows] (the FP4 GPU kernel reads them in place)."""
        w = self.w.stacked[(L, site)]
        if self.fp4:
            return fp4_grouped_linear(x, w.codes, w.scales, w.g, counts, tiles=tiles, x_rows=x_rows,
                                      backend=self.backend)
        if x_rows is not None:
            x = x[x_rows]
        if x.is_cuda and self.backend != "torch":
            return torch._grouped_mm(x, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
        return torch.cat([chunk @ w[e].T for e, chunk in enumerate(x.split(counts.tolist()))])

    def _moe(self, L, p, x, proj, rows, routed, codes=False):
        """y + the MoE block of y's norm, y = x + proj (the attention block's output, `_linear`'s
        product): top-k routing, then every (token, slot) row through its expert as two grouped
        GEMMs (rows sorted by expert, tokens ascending within an expert)."""
        cfg, w = self.cfg, self.w
        n, k = x.shape[0], cfg.top_k
        h_in, h, x = self._norm_site(rows, L, "fc1", x, w.dense(p + "pre_mlp_layernorm.weight"), codes, product=proj)
        top, gate = route(h, w.dense(p + "mlp.router.weight"), k, backend=self.backend)
        routed[L] = top
        tok, slot, pos, counts = expert_order(top, cfg.num_experts, backend=self.backend)
        tiles = expert_tiles(counts, n * k) if self.fp4 and h.is_cuda and self.backend != "torch" and n else None
        gate_up = self._experts(h_in, L, "fc1", counts, tiles, x_rows=tok)  # rows in expert order
        fc2 = {} if rows is not None else None
        act_in = self._swiglu_site(fc2, L, gate_up, codes)
        if rows is not None:  # captured rows in token order, as the trainer's records are
            def token_order(t):
                out = t.new_empty((n, k) + t.shape[1:])
                out[tok, slot] = t
                return out.reshape((n * k,) + t.shape[1:])
            rows[(L, "fc2")] = map_rows(token_order, fc2[(L, "fc2")])
        y = self._experts(act_in, L, "fc2", counts, tiles)
        return combine_experts(y.to(h.dtype), gate, tok, slot, pos, residual=x, backend=self.backend)


def rows_per_token(cfg: ModelConfig, site: str) -> int:
    """Captured rows per token of an FP4 site: one per KV head for k / v, one per routed expert
    for fc2, else one."""
    return {"k": cfg.num_key_value_heads, "v": cfg.num_key_value_heads, "fc2": cfg.top_k}.get(site, 1)


class StepInputs:
    """The host side of a decode graph's inputs: token ids, positions, cache slots, block tables
    [B, max_blocks] and lengths, filled in place for each step (pinned on CUDA, for asynchronous
    copies). A row's block table is rewritten only from where it changed: a sequence that keeps
    its row between steps only appends a block every block_size tokens, and converting whole
    Python lists every step cost more host time than the step's GPU work at large batches.

    Contract: a segment's `block_table` list only grows in place while the same sequence decodes
    (the engine's tables do: blocks are appended, never replaced); a new list object is a new
    sequence and rewrites its row.
    """

    def __init__(self, batch_size: int, max_blocks: int, scratch_block: int, block_size: int, pin: bool):
        # one buffer, so that a step's inputs reach the GPU in one copy (five took up to 0.19 ms
        # of host time a step: bench/results/decode_pass7_2026-12-01_h200.log)
        int32s = batch_size * (max_blocks + 1)
        self.buffer = torch.zeros(3 * batch_size + (int32s + 1) // 2, dtype=torch.long, pin_memory=pin)
        self.tensors = self.views(self.buffer, batch_size, max_blocks)
        self.arrays = {name: t.numpy() for name, t in self.tensors.items()}
        self.arrays["tables"].fill(scratch_block)
        self.batch_size, self.max_blocks, self.scratch, self.block_size = batch_size, max_blocks, scratch_block, block_size
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * batch_size  # (table written, its length)

    @staticmethod
    def views(buffer: torch.Tensor, batch_size: int, max_blocks: int) -> dict[str, torch.Tensor]:
        """The inputs as views of one int64 buffer (host or device): ids, pos, slots int64 [B],
        then tables int32 [B, max_blocks] and lens int32 [B]."""
        b = batch_size
        int32s = buffer[3 * b:].view(torch.int32)
        return {"ids": buffer[:b], "pos": buffer[b:2 * b], "slots": buffer[2 * b:3 * b],
                "tables": int32s[:b * max_blocks].view(b, max_blocks), "lens": int32s[b * max_blocks:b * (max_blocks + 1)]}

    def fill(self, segments: list[Segment]) -> None:
        """Write one decode step of these sequences (padding rows: token 0 at position 0 of the
        scratch block)."""
        n, bs, tables = len(segments), self.block_size, self.arrays["tables"]
        if n > self.batch_size or any(len(s.token_ids) != 1 or len(s.block_table) > self.max_blocks for s in segments):
            raise ValueError(f"a decode graph for {self.batch_size} sequences of up to {self.max_blocks} blocks "
                             "cannot run this batch")
        for i in range(self.batch_size):
            table = segments[i].block_table if i < n else None
            old, written = self._rows[i]
            if table is not None and table is old and len(table) >= written:
                tables[i, written:len(table)] = table[written:]
            else:
                tables[i, :written] = self.scratch
                if table is not None:
                    tables[i, :len(table)] = table
            self._rows[i] = (table, 0 if table is None else len(table))
        pos, ids = self.arrays["pos"], self.arrays["ids"]
        pos[:n] = [s.start for s in segments]
        pos[n:] = 0
        ids[:n] = [s.token_ids[0] for s in segments]
        ids[n:] = 0
        self.arrays["slots"][:] = tables[np.arange(self.batch_size), pos // bs].astype(np.int64) * bs + pos % bs
        self.arrays["lens"][:] = pos + 1


class DecodeGraph:
    """One decode step for a fixed batch size, captured as a CUDA graph.

    Token ids, positions, cache slots, block tables [B, max_blocks] and lengths live in static
    buffers that `run` fills before each replay (from `StepInputs`); the outputs (logits,
    captured site rows of `capture_layers`, routed experts) are the graph's static outputs,
    overwritten by the next replay. Warm-up and capture write K/V only into `scratch_block`, a
    cache block reserved for it, and so do the padding rows of a smaller batch. `pool`: a graph
    memory pool shared with the other batch sizes' graphs (they never replay at the same time).
    `codes`: as `forward`.
    """

    def __init__(self, runner: ModelRunner, batch_size: int, max_blocks: int, scratch_block: int,
                 capture_layers=frozenset(), pool=None, codes: bool = False):
        dev = runner.w.device
        bs = runner.cache.block_size
        self.runner, self.batch_size, self.max_blocks, self.scratch = runner, batch_size, max_blocks, scratch_block
        self.inputs = StepInputs(batch_size, max_blocks, scratch_block, bs, pin=True)
        self.inputs.fill([])  # every row padding: the scratch block
        self.buffer = self.inputs.buffer.to(dev)
        for name, t in StepInputs.views(self.buffer, batch_size, max_blocks).items():  # what the graph reads
            setattr(self, name, t)
        self.decode_only, self.last = True, None
        self._copied = torch.cuda.Event()  # recorded once the last copies have read the host buffers
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile the Triton kernels and warm the allocator
            for _ in range(2):
                runner.forward_batch(self, capture_layers, codes=codes)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, self.captured, self.routed = runner.forward_batch(self, capture_layers, codes=codes)

    def run(self, segments: list[Segment], ids: torch.Tensor | None = None):
        """`ModelRunner.forward` of one decode step of these sequences (`ids` as there):
        (logits [n, V], captured rows, routed experts), views of the static outputs; fewer than
        batch_size sequences are padded with the scratch block."""
        n, cfg = len(segments), self.runner.cfg
        self._copied.synchronize()  # the previous step's copies have read the host buffers
        self.inputs.fill(segments)
        self.buffer.copy_(self.inputs.buffer, non_blocking=True)
        self._copied.record()
        if ids is not None:
            if ids.shape != (n,):
                raise ValueError(f"DecodeGraph.run: ids {tuple(ids.shape)} for {n} sequences")
            self.ids[:n].copy_(ids)
        self.graph.replay()
        captured = {(layer, site): map_rows(lambda t, r=n * rows_per_token(cfg, site): t[:r], rows)
                    for (layer, site), rows in self.captured.items()}
        return self.logits[:n], captured, {layer: t[:n] for layer, t in self.routed.items()}
