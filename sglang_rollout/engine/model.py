"""One forward of the Qwen3-MoE model over a batch of segments (prefill chunks and decodes).

The arithmetic follows the trainer's (megatron_trace.megatron): fused QKV with query groups
interleaved, QK RMSNorm then RoPE (non-interleaved halves), fp32 router with softmax over the
top-k logits, the gate weight on each expert's fc2 output, BF16 residual stream. In fp4
precision every FP4 site quantizes its input rows with one global scale per row (K and V per
(token, KV head), as stored in the paged cache) and runs on the dequantized values (Hopper has
no FP4 tensor cores); weights stay packed and are dequantized for the matmul.

When asked, the pre-quantization rows of the FP4 sites are returned in guidance order, so the
engine can record how it rounded (megatron_trace.guidance.capture).

Shape suffixes (as in trace_kernels.fp4.reference): a name ends in the letters of its
dimensions, e.g. x_NH is [N, H].
    N  new tokens of the forward (every segment's, packed)    B  segments (sequences)
    H  hidden size        V  vocabulary
    Q  query heads        G  KV heads (query groups)           D  head dim
    C  channels per query group in the fused QKV view: Q/G queries, then K, then V
    E  experts            K  routed experts per token (top-k)  F  2 x expert intermediate size (gate | up)
    R  rows of an FP4 site: N (qkv, proj, fc1), N * G (k, v), N * K (fc2, in expert order here)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_trace.model_config import ModelConfig
from trace_kernels.fp4 import fake_quantize_rows
from trace_kernels.fp4.linear import (
    expert_tiles,
    fp4_grouped_linear,
    fp4_linear_parts,
    sum_parts,
)
from trace_kernels.fp4.paged_attention import cached_causal_attention, paged_decode_attention
from trace_kernels.fused_inputs import (
    add_rms_norm_fake_quantize_rows,
    rms_norm_fake_quantize_rows,
    silu_mul,
    silu_mul_fake_quantize_rows,
)
from trace_kernels.moe_routing import combine_experts, expert_order, route, router_logits, top_k_sigmoid_grouped
from trace_kernels.norm_rope import (
    deinterleave,
    qk_norm_rope,
    qk_norm_rope_into_cache,
    rms_norm,
    rope,
)

from .kv_cache import PagedKVCache
from .rope import ModelRope, rotary_dim
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


RowKeep = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple[torch.Tensor, ...]]
"""What a captured FP4 site keeps, computed in the forward (inside a decode graph too): f(its rows
x [R, K] bf16, the quantize kernel's (mantissa bits uint8 [R, K/8], block scale bytes uint8
[R, K/16], g float32 [R])) -> row-aligned parts [R, ...]. `keep_codes` for dense guidance,
`guidance.sparse_parts_of_dense` for sparse."""


def keep_codes(x_RK: torch.Tensor, kept: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The dense coding's `RowKeep`: the quantize kernel's (bits, scales, g) as they are."""
    return kept


class _Batch:
    """Index tensors of one forward, built once: token ids, positions, cache slots [N], the block
    tables [B, max_blocks] and sequence lengths [B]; in a batch that mixes prefill chunks with
    one-token segments (decodes), those segments' rows, tables and lengths (`single_*`), whose
    attention runs batched in the paged kernel as a decode-only batch's does."""

    def __init__(self, segments: list[Segment], block_size: int, dev):
        self.segments = segments
        lengths = [len(s.token_ids) for s in segments]
        counts = torch.tensor(lengths)
        width = max(len(s.block_table) for s in segments)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in segments],
                              dtype=torch.int32)
        seg_of = torch.repeat_interleave(torch.arange(len(segments)), counts)
        starts = torch.tensor([s.start for s in segments])
        first = torch.tensor([0] + lengths[:-1]).cumsum(0)
        pos = starts[seg_of] + torch.arange(len(seg_of)) - first[seg_of]
        self.ids = torch.tensor([t for s in segments for t in s.token_ids], device=dev)
        self.pos = pos.to(dev)
        self.slots = (tables[seg_of, pos // block_size].long() * block_size + pos % block_size).to(dev)
        self.decode_only = len(seg_of) == len(segments)
        self.tables = tables.to(dev)
        lens = (starts + counts).to(torch.int32)
        self.lens = lens.to(dev)
        self.last = None if self.decode_only else (first + counts - 1).to(dev)
        single = [i for i, m in enumerate(lengths) if m == 1]
        self.single_rows = self.single_tables = self.single_lens = None
        if single and not self.decode_only:
            self.single_rows = first[single].to(dev)
            self.single_tables = tables[single].to(dev)
            self.single_lens = lens[single].to(dev)


class ModelRunner:
    """kernels: "torch" (dequantize whole weights, gather and dequantize KV rows, SDPA, torch's
    norms and routing) or "triton" (FP4 GEMMs that dequantize in registers; decode-only batches
    read the FP4 KV cache in the paged attention kernel; trace_kernels' norm, RoPE and MoE
    routing kernels). "auto" on CUDA: "triton", except the FP4 decode attention and the
    decode-sized FP4 GEMMs, which run trace_kernels.fp4.cuda_decode's CUDA C++ kernels where
    they apply (Hopper; head dim 128; K a multiple of 128)."""

    def __init__(self, model_cfg: ModelConfig, weights: EngineWeights, cache: PagedKVCache, fp4: bool,
                 kernels: str = "auto"):
        self.model_cfg, self.w, self.cache, self.fp4 = model_cfg, weights, cache, fp4
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.backend = kernels
        c = model_cfg
        self.rot_dim = rotary_dim(c)
        self.rope = ModelRope.of(c, weights.device)
        # Qwen3's attention: q/k norm then RoPE over whole heads, no biases (the fused kernels)
        self.fused_qk = not c.mla and c.use_qk_norm and not c.attention_bias and self.rot_dim == c.head_dim

    def _site(self, rows, layer, name, x, keep=None):
        """Fake-quantize an FP4 site's input rows (fp4) and, when the layer is captured, keep the
        rows, or with `keep` (fp4) what it makes of them and the quantize kernel's capture."""
        x2 = x.reshape(-1, x.shape[-1])
        if not self.fp4:
            if rows is not None:
                rows[(layer, name)] = x2
            return x
        xq, kept = fake_quantize_rows(x2, capture=rows is not None and keep is not None, backend=self.backend)
        if rows is not None:
            rows[(layer, name)] = x2 if kept is None else keep(x2, kept)
        return xq.view_as(x)

    def _norm_site(self, rows, layer, name, x, weight, keep=None, product=None):
        """(the FP4 site's input: rms_norm(x) fake-quantized in fp4, the norm's rows, x), where
        with a `product` (`_linear`'s) x is first made x + product, the residual stream after a
        block. In one kernel on the GPU in fp4 (not where a capture keeps the rows themselves)."""
        eps = self.model_cfg.rms_norm_eps
        if self.fp4 and (rows is None or keep is not None):
            capture = rows is not None
            if product is None:
                xq, h, kept = rms_norm_fake_quantize_rows(x, weight, eps, capture=capture, backend=self.backend)
            else:
                xq, h, kept, x = add_rms_norm_fake_quantize_rows(product, x, weight, eps, capture=capture,
                                                                 backend=self.backend)
            if rows is not None:
                rows[(layer, name)] = keep(h, kept)
            return xq, h, x
        if product is not None:
            x = sum_parts(product, x)
        h = rms_norm(x, weight, eps, backend=self.backend)
        return self._site(rows, layer, name, h, keep), h, x

    def _swiglu_site(self, rows, layer, gate_up, keep=None, site="fc2"):
        """fc2's (or the shared experts' `shared_fc2`) input: silu(gate) * up of gate_up [R, 2I],
        fake-quantized in fp4 (one kernel on the GPU, as `_norm_site`); its captured rows go to
        `rows` (in the rows' own order)."""
        if self.fp4 and (rows is None or keep is not None):
            xq, act, kept = silu_mul_fake_quantize_rows(gate_up, capture=rows is not None, backend=self.backend)
            if rows is not None:
                rows[(layer, site)] = keep(act, kept)
            return xq
        return self._site(rows, layer, site, silu_mul(gate_up, backend=self.backend), keep)

    def _linear(self, x, name):
        """x [n, K] @ W^T for an FP4-site weight (packed in fp4 precision), as `fp4_linear_parts`
        leaves it: bf16 [n, N], or on the GPU FP32 partial products [S, n, N] that the next
        kernel adds up (`sum_parts`)."""
        if self.fp4:
            return fp4_linear_parts(x, self.w.tensors[name], backend=self.backend)
        return x @ self.w.dense(name).T

    @torch.no_grad()
    def forward(self, segments: list[Segment], capture_layers=frozenset(), all_logits: bool = False,
                keep: RowKeep | None = None, ids: torch.Tensor | None = None):
        """Run the segments; write their K/V into the cache. `ids` (int64 [N] on the model's
        device), if given, are the new tokens in place of the segments' token_ids: tokens a
        previous step drew and the host has not seen yet.

        Returns:
            logits float32 [len(segments), V] (each segment's last token) or [N, V] (all_logits),
            captured site rows {(layer, site): [R, K]} for `capture_layers` (R = N, or N * kv_heads
            for k/v, N * top_k for fc2; with `keep` (fp4): what it makes of the rows and the fused
            quantize kernel's capture instead),
            routed experts {layer: int64 [N, top_k]}.
        """
        batch = _Batch(segments, self.cache.block_size, self.w.device)  # index tensors built once per forward
        if ids is not None:
            if ids.shape != batch.ids.shape:
                raise ValueError(f"forward: ids {tuple(ids.shape)} for {batch.ids.numel()} new tokens")
            batch.ids = ids
        return self.forward_batch(batch, capture_layers, all_logits, keep)

    def forward_batch(self, batch, capture_layers=frozenset(), all_logits: bool = False, keep: RowKeep | None = None):
        """`forward` on prebuilt index tensors (`_Batch` or the static buffers of a `DecodeGraph`).
        Decode-only batches run without host synchronisation (GQA), so they can be graph-captured."""
        cfg, w = self.model_cfg, self.w
        ids, pos = batch.ids, batch.pos
        captured, routed = {}, {}
        x_NH = w.dense("embedding.word_embeddings.weight")[ids]
        cos, sin = self.rope.tables(pos, x_NH.dtype)  # once per forward
        for L in range(cfg.num_layers):
            p = f"decoder.layers.{L}."
            rows = captured if L in capture_layers else None
            attend = self._mla if cfg.mla else self._gqa
            ctx = attend(L, p + "self_attention.", batch, x_NH, w.dense(p + "input_layernorm.weight"), cos, sin, rows,
                         keep)
            proj = self._linear(self._site(rows, L, "proj", ctx, keep), p + "self_attention.linear_proj.weight")
            ffn = self._moe if cfg.is_moe_layer(L) else self._dense_ffn
            x_NH = ffn(L, p, x_NH, proj, rows, routed, keep)
        x_NH = rms_norm(x_NH, w.dense("decoder.final_layernorm.weight"), cfg.rms_norm_eps, backend=self.backend)
        if not all_logits and batch.last is not None:
            x_NH = x_NH[batch.last]  # [B, H]: each segment's last token
        return (x_NH @ w.dense("output_layer.weight").T).float(), captured, routed

    def _gqa(self, L, a, batch, x_NH, norm_weight, cos, sin, rows, keep):
        """Grouped-query attention of the input_layernorm of x_NH: its K and V into the cache,
        the context [N, Q * D] out. Qwen3's shape (q/k norm, whole-head RoPE, no biases) runs the
        fused norm + RoPE kernels; the rest (GLM-4.5: QKV biases, partial RoPE) torch's ops."""
        cfg, w = self.model_cfg, self.w
        nq, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_in, _, _ = self._norm_site(rows, L, "qkv", x_NH, norm_weight, keep)
        qkv = self._linear(qkv_in, a + "linear_qkv.weight")
        if not self.fused_qk:
            qkv = sum_parts(qkv)
            if cfg.attention_bias:
                qkv = qkv + w.dense(a + "linear_qkv.bias").to(qkv.dtype)
        qkv_NGCD = qkv.view(*qkv.shape[:-1], ng, nq // ng + 2, d)  # [S, ...] partials on the GPU
        if self.fused_qk:
            qk_norm = (w.dense(a + "q_layernorm.weight"), w.dense(a + "k_layernorm.weight"), cfg.rms_norm_eps, cos, sin)
            if rows is None:  # K and V go into the cache from the norm + RoPE kernel
                q_NQD = qk_norm_rope_into_cache(qkv_NGCD, *qk_norm, self.cache.k[L], self.cache.v[L], batch.slots,
                                                backend=self.backend)
                return self._attention(L, batch, q_NQD).flatten(1)
            qkv_NGCD = sum_parts(qkv_NGCD)
            q_NQD, k_NGD = qk_norm_rope(qkv_NGCD, *qk_norm, backend=self.backend)
        else:
            q_NQD, k_NGD = qkv_NGCD[:, :, :-2].flatten(1, 2), qkv_NGCD[:, :, -2]
            if cfg.use_qk_norm:
                q_NQD = rms_norm(q_NQD, w.dense(a + "q_layernorm.weight"), cfg.rms_norm_eps, backend=self.backend)
                k_NGD = rms_norm(k_NGD, w.dense(a + "k_layernorm.weight"), cfg.rms_norm_eps, backend=self.backend)
            q_NQD, k_NGD = self._rope(q_NQD, cos, sin), self._rope(k_NGD, cos, sin)
        v_NGD = qkv_NGCD[:, :, -1]
        # with keep (captured), the rounding the cache itself holds
        k_q, v_q = k_NGD, v_NGD
        if self.fp4:
            k_q, v_q = PagedKVCache.quantize_rows(k_NGD), PagedKVCache.quantize_rows(v_NGD)
        if rows is not None:
            k_RD, v_RD = k_NGD.reshape(-1, d), v_NGD.reshape(-1, d)
            rows[(L, "k")], rows[(L, "v")] = ((keep(k_RD, k_q.rounding()), keep(v_RD, v_q.rounding()))
                                              if keep is not None and self.fp4 else (k_RD, v_RD))
        self.cache.write(L, batch.slots, k_q, v_q)
        return self._attention(L, batch, q_NQD).flatten(1)

    def _rope(self, x, cos, sin):
        """RoPE over the first rot_dim channels of each head of x [n, heads, d] (all: Qwen3 and
        DeepSeek's rope part; GLM-4.5 half), the rest passed through, as Megatron applies it."""
        if self.rot_dim == x.shape[-1]:
            return rope(x, cos, sin)
        return torch.cat([rope(x[..., :self.rot_dim], cos, sin), x[..., self.rot_dim:]], -1)

    def _mla(self, L, a, batch, x_NH, norm_weight, cos, sin, rows, keep):
        """Multi-head latent attention (docs/design.md section 3.1) of the input_layernorm of x_NH:
        the KV latent after its norm (the `kv` site: FP4 in fp4) and the RoPE'd key part (BF16)
        into the cache, the context [N, Q * v_head_dim] out. Each sequence's cached latents are
        up-projected to keys and values (`kv_b` reads them as the cache holds them)."""
        cfg, w = self.model_cfg, self.w
        n, nq, d = x_NH.shape[0], cfg.num_attention_heads, cfg.head_dim
        nope, rot, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        h_in, _, _ = self._norm_site(rows, L, "qkv", x_NH, norm_weight, keep)  # both down projections read it
        latent_NR, k_pe = sum_parts(self._linear(h_in, a + "linear_kv_down_proj.weight")).split([r, rot], -1)
        if cfg.q_lora_rank:
            q_lat = sum_parts(self._linear(h_in, a + "linear_q_down_proj.weight"))
            q_in, _, _ = self._norm_site(rows, L, "q_up", q_lat, w.dense(a + "q_layernorm.weight"), keep)
            q = self._linear(q_in, a + "linear_q_up_proj.weight")
        else:
            q = self._linear(h_in, a + "linear_q_proj.weight")
        q_nope, q_pe = sum_parts(q).view(n, nq, d).split([nope, rot], -1)
        q_NQD = torch.cat([q_nope, rope(deinterleave(q_pe), cos, sin)], -1)
        latent_NR = rms_norm(latent_NR, w.dense(a + "kv_layernorm.weight"), cfg.rms_norm_eps, backend=self.backend)
        lat_q = PagedKVCache.quantize_rows(latent_NR[:, None]) if self.fp4 else latent_NR[:, None]
        if rows is not None:
            rows[(L, "kv")] = keep(latent_NR, lat_q.rounding()) if keep is not None and self.fp4 else latent_NR
        self.cache.write(L, batch.slots, lat_q, rope(deinterleave(k_pe[:, None]), cos, sin))
        ctx_NQV = torch.empty(n, nq, vd, dtype=x_NH.dtype, device=x_NH.device)
        offset = 0
        for seg in batch.segments:
            m = len(seg.token_ids)
            latent, k_pe_ctx = self.cache.read(L, self.cache.slots(seg.block_table, 0, seg.start + m))
            kv = sum_parts(self._linear(latent[:, 0], a + "linear_kv_up_proj.weight")).view(-1, nq, nope + vd)
            k_nope, values = kv.split([nope, vd], -1)
            keys = torch.cat([k_nope, k_pe_ctx.expand(-1, nq, -1)], -1)
            ctx_NQV[offset:offset + m] = cached_causal_attention(q_NQD[offset:offset + m], keys, values, seg.start,
                                                                 self.rope.softmax_scale)
            offset += m
        return ctx_NQV.flatten(1)

    def _attention(self, L, batch, q_NQD):
        """Attend over each sequence's cache (the segments' own K/V already written): [N, Q, D].
        With the paged kernel (not "torch"; on the CPU only "triton"), one-token segments run in
        it, batched, whether the batch is decode-only or mixes them with prefill chunks (a
        mixed step of 63 decodes at 8k would otherwise dequantize each one's whole cache); the
        prefill chunks attend over their cached prefix one segment at a time."""
        n, nq, d = q_NQD.shape
        paged = self.backend != "torch" and (self.backend == "triton" or q_NQD.is_cuda)
        # "auto" on a GPU: the CUDA C++ kernel where it applies (FP4 cache, Hopper, head dim 128), else Triton
        backend = "auto" if self.backend == "auto" else "triton"
        if batch.decode_only and paged:
            return paged_decode_attention(q_NQD, self.cache.k[L], self.cache.v[L], batch.tables, batch.lens,
                                          self.cache.block_size, backend=backend)
        ctx_NQD = torch.empty(n, nq, d, dtype=q_NQD.dtype, device=q_NQD.device)
        singles = paged and batch.single_rows is not None
        if singles:
            ctx_NQD[batch.single_rows] = paged_decode_attention(
                q_NQD[batch.single_rows], self.cache.k[L], self.cache.v[L], batch.single_tables, batch.single_lens,
                self.cache.block_size, backend=backend)
        offset = 0
        for seg in batch.segments:
            m = len(seg.token_ids)
            if not (singles and m == 1):
                keys, values = self.cache.read(L, self.cache.slots(seg.block_table, 0, seg.start + m))
                ctx_NQD[offset:offset + m] = cached_causal_attention(q_NQD[offset:offset + m], keys, values, seg.start)
            offset += m
        return ctx_NQD

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

    def _ffn(self, rows, L, h_in, fc1, fc2, keep, site="fc2"):
        """A SwiGLU FFN's output (bf16 [N, H]) of its fake-quantized input h_in: the weights
        `fc1` and `fc2`, fc2's input the FP4 site `site`."""
        gate_up = sum_parts(self._linear(h_in, fc1))
        return sum_parts(self._linear(self._swiglu_site(rows, L, gate_up, keep, site), fc2))

    def _dense_ffn(self, L, p, x_NH, proj, rows, routed, keep=None):
        """y + the dense FFN of y's norm, y = x + proj (a dense leading layer of the DeepSeek-V3
        family): fc1 and fc2 sites of one row per token."""
        h_in, _, x_NH = self._norm_site(rows, L, "fc1", x_NH, self.w.dense(p + "pre_mlp_layernorm.weight"), keep,
                                        product=proj)
        return x_NH + self._ffn(rows, L, h_in, p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight", keep)

    def _route(self, p, h_NH):
        """(experts int64 [N, top_k], gates float32 [N, top_k]) of the normed rows h_NH: softmax
        over the top-k FP32 logits (Qwen3), or the DeepSeek-V3 family's sigmoid scores with the
        expert bias picking, group-limited, gates normalised and scaled."""
        cfg, w = self.model_cfg, self.w
        if cfg.scoring_func == "softmax":
            return route(h_NH, w.dense(p + "mlp.router.weight"), cfg.top_k, backend=self.backend)
        return top_k_sigmoid_grouped(router_logits(h_NH, w.dense(p + "mlp.router.weight")), cfg.top_k,
                                     w.dense(p + "mlp.router.expert_bias"), n_group=cfg.n_group,
                                     topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                                     normalize=cfg.norm_topk_prob)

    def _moe(self, L, p, x_NH, proj, rows, routed, keep=None):
        """y + the MoE block of y's norm, y = x + proj (the attention block's output, `_linear`'s
        product): top-k routing, then every (token, slot) row through its expert as two grouped
        GEMMs (rows sorted by expert, tokens ascending within an expert); the shared experts, if
        any, read the same input row and add to the routed output (as Megatron's MoE layer)."""
        cfg, w = self.model_cfg, self.w
        n, k = x_NH.shape[0], cfg.top_k
        h_in, h_NH, x_NH = self._norm_site(rows, L, "fc1", x_NH, w.dense(p + "pre_mlp_layernorm.weight"), keep,
                                           product=proj)
        experts_NK, gate_NK = self._route(p, h_NH)
        routed[L] = experts_NK
        # each row R of the expert order: its token, its slot among the token's K, where it sits; rows per expert
        tok_R, slot_R, pos_R, counts_E = expert_order(experts_NK, cfg.num_experts, backend=self.backend)
        tiles = expert_tiles(counts_E, n * k) if self.fp4 and h_NH.is_cuda and self.backend != "torch" and n else None
        gate_up_RF = self._experts(h_in, L, "fc1", counts_E, tiles, x_rows=tok_R)
        fc2 = {} if rows is not None else None
        act_in = self._swiglu_site(fc2, L, gate_up_RF, keep)
        if rows is not None:  # captured rows in token order, as the trainer's records are
            def token_order(t):
                out = t.new_empty((n, k) + t.shape[1:])
                out[tok_R, slot_R] = t
                return out.reshape((n * k,) + t.shape[1:])
            rows[(L, "fc2")] = map_rows(token_order, fc2[(L, "fc2")])
        y_RH = self._experts(act_in, L, "fc2", counts_E, tiles)
        if not cfg.n_shared_experts:
            return combine_experts(y_RH.to(h_NH.dtype), gate_NK, tok_R, slot_R, pos_R, residual=x_NH,
                                   backend=self.backend)
        out = combine_experts(y_RH.to(h_NH.dtype), gate_NK, tok_R, slot_R, pos_R, backend=self.backend)
        shared = self._ffn(rows, L, h_in, p + "mlp.shared_experts.linear_fc1.weight",
                           p + "mlp.shared_experts.linear_fc2.weight", keep, site="shared_fc2")
        return x_NH + (out + shared)

