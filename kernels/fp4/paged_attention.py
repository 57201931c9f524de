"""Decode attention that reads K and V straight from a paged NVFP4 (or BF16) KV cache.

One query token per sequence attends over all its cached tokens. The cache holds, per token
slot and KV head, packed E2M1 codes [d/2], E4M3 block scales [d/16] and one FP32 global scale
(slot = block * block_size + offset; each sequence's blocks in its row of `block_tables`). The
torch reference gathers and dequantizes the rows (to BF16), then runs softmax attention. The
Triton kernel (flash-decoding: chunks of the context in parallel, then a combine) dequantizes K
and V tiles in registers exactly as `dequantize` does, to the same BF16 values the trainer's
fake-quantized attention uses, and runs an online softmax in FP32. Hopper has no FP4 MMA, so
this per-element work, not bytes, bounds the FP4 kernel (bench/decode_kernels.py); on Hopper the
FP4 chunks run `cuda_decode.split_attention` instead, the same values with half the instructions.

Shapes: q [B, Hq, d] bf16, codes uint8 [S, Hkv, d/2], scales uint8 [S, Hkv, d/16] (E4M3 bits),
g float32 [S, Hkv, 1] (or a BF16 cache: rows [S, Hkv, d]), block_tables int32 [B, max_blocks],
seq_lens int32 [B]; out [B, Hq, d].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from . import cuda_decode
from .api import _use_triton, dequantize
from .formats import Format
from .qtensor import QTensor

try:
    import triton
    import triton.language as tl

    from .triton_fp4 import _bf16_rne, _dequant_halves, _interpreting
except ImportError:  # pragma: no cover
    triton = None


# Flash-decoding: each (sequence, KV head) is cut into at most MAX_SPLITS chunks attended in
# parallel, then combined. A sequence's chunk is the smallest power of two >= MIN_CHUNK tokens
# that covers it in MAX_SPLITS pieces, computed on the device from its length: the split follows
# each sequence, not the block table's width (a CUDA graph's table is as wide as the longest
# context the engine allows), and the partial results take B * Hq * MAX_SPLITS rows whatever
# the width. Unsplit, a batch of 64 sequences with 4 KV heads is 256 programs walking the context.
MAX_SPLITS = 32
MIN_CHUNK = 256
TILE = {"block_t": 32, "num_warps": 4}  # cached tokens per loop step (bench/decode_kernels.py --sweep)
# Warps of the combine kernel (one (sequence, query head) a program): at batch 64 / 8k, one warp
# 158.6 us for split + combine, four 161.3 (bench/results/decode_pass7_2026-12-01_h200.log).
COMBINE_WARPS = 1


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size: int, *,
                           scale: float | None = None, min_chunk: int = MIN_CHUNK, max_splits: int | None = None,
                           backend: str = "auto") -> torch.Tensor:
    """Softmax attention of one query per sequence over its cached keys (GQA: query head h reads
    KV head h // (Hq / Hkv)). k_cache / v_cache: dicts with "codes", "scales", "g" (FP4) or
    "rows" (BF16). min_chunk / max_splits: the split of each sequence (see MAX_SPLITS); min_chunk
    a power of two, at least TILE["block_t"]; max_splits by default MAX_SPLITS for the Triton
    kernel, `cuda_decode.attention_splits` (about two waves of programs) for the CUDA one.
    backend: "torch" (gather, dequantize, softmax), "triton", "cuda" (the CUDA C++ split kernel
    of `cuda_decode`: FP4 cache, Hopper, head dim 128; else a ValueError) or "auto" (on a GPU:
    "cuda" where it applies, else "triton")."""
    b, hq, d = q.shape
    fp4 = "codes" in k_cache
    hkv = (k_cache["codes"] if fp4 else k_cache["rows"]).shape[1]
    if hq % hkv or d % 16:
        raise ValueError(f"paged_decode_attention: {hq} query heads over {hkv} KV heads of dim {d}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    use_cuda = backend in ("auto", "cuda") and cuda_decode.supports_attention(q, k_cache, block_size)
    if backend == "cuda" and not use_cuda:
        raise ValueError("paged_decode_attention: backend='cuda' needs an FP4 cache on a GPU of compute capability "
                         f">= 9.0, head dim {cuda_decode.HEAD_DIM}, <= {cuda_decode.MAX_GROUP} query heads per KV "
                         f"head and blocks of a multiple of 16 tokens (got d={d}, {hq}/{hkv} heads, "
                         f"block_size={block_size}, device {q.device})")
    if not use_cuda and not _use_triton(q, backend):
        return _reference(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale)
    block_t = TILE["block_t"]
    if max_splits is None:
        max_splits = cuda_decode.attention_splits(b, hkv, q.device, MAX_SPLITS) if use_cuda else MAX_SPLITS
    if min_chunk < block_t or min_chunk & (min_chunk - 1) or max_splits < 1:
        raise ValueError(f"paged_decode_attention: min_chunk={min_chunk} must be a power of two >= {block_t}, "
                         f"max_splits={max_splits} >= 1")
    kp = (k_cache["codes"], k_cache["scales"], k_cache["g"]) if fp4 else (k_cache["rows"],) * 3
    vp = (v_cache["codes"], v_cache["scales"], v_cache["g"]) if fp4 else (v_cache["rows"],) * 3
    group = hq // hkv
    width = block_tables.shape[1] * block_size  # no sequence is longer
    splits = max(1, min(max_splits, triton.cdiv(width, min_chunk)))
    max_chunk = max(min_chunk, triton.next_power_of_2(triton.cdiv(width, splits)))
    doublings = (max_chunk // min_chunk).bit_length() - 1  # min_chunk * 2**doublings == max_chunk
    part_o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, hq, splits, 2), dtype=torch.float32, device=q.device)
    if use_cuda:  # registers-only MMA fragments: bench/results/NOTES-decode.md
        cuda_decode.split_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, part_o, part_ml,
                                    block_size=block_size, scale=scale, min_chunk=min_chunk, doublings=doublings,
                                    splits=splits)
    else:
        _split_kernel[(b, hkv, splits)](  # one program per (sequence, KV head, chunk): K/V read once for the group
            q.contiguous(), *kp, *vp, block_tables, seq_lens, part_o, part_ml, block_tables.shape[1], scale,
            HQ=hq, HKV=hkv, G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_SIZE=block_size,
            BLOCK_T=block_t, MIN_CHUNK=min_chunk, DOUBLINGS=doublings, SPLITS=splits, IS_FP4=fp4,
            INTERPRET=_interpreting(), SMALL=d < 32, num_warps=TILE["num_warps"],
        )
    out = torch.empty_like(q)
    _combine_kernel[(b, hq)](part_o, part_ml, seq_lens, out, HQ=hq, D=d, MIN_CHUNK=min_chunk, DOUBLINGS=doublings,
                             SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), INTERPRET=_interpreting(),
                             num_warps=COMBINE_WARPS)
    return out


def cached_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                            scale: float | None = None) -> torch.Tensor:
    """One sequence's queries q [m, Hq, d] at positions start .. start + m - 1 over its cached
    keys and values [start + m, Hkv, d] (positions 0 .. start + m - 1, the new ones included),
    causal, GQA: [m, Hq, d] in q's dtype, with SDPA's default scale 1/sqrt(d) (or `scale`: MLA
    under YaRN). What the built-in engine runs for prefill (and on the CPU for decode) and
    SGLang's trace_fp4 backend runs too, so that both give the same bits for the same rows.

    On a GPU the mask is torch's lower-right causal bias over 4-D [1, H, seq, d] views, which
    SDPA runs as flash attention with the grouped K/V heads as they are; an explicit mask (or
    3-D inputs) would send GQA to SDPA's math kernel, which materialises every [Hq, m, start + m]
    score (GBs at 8k prompts). On the CPU the explicit mask (the bias would warn per call)."""
    m, nq, _ = q.shape
    n = keys.shape[0]
    if n != start + m:
        raise ValueError(f"cached_causal_attention: {n} cached keys for queries at positions "
                         f"{start} .. {start + m - 1}")
    gqa = keys.shape[1] != nq
    q_, k_, v_ = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if q.is_cuda:
        out = F.scaled_dot_product_attention(q_[None], k_[None], v_[None], attn_mask=causal_lower_right(m, n),
                                             enable_gqa=gqa, scale=scale)[0]
    else:
        allowed = torch.arange(n, device=q.device)[None] <= (start + torch.arange(m, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, enable_gqa=gqa, scale=scale)
    return out.transpose(0, 1)


def read_cache_rows(cache: dict, slots: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """BF16 K or V rows [n, Hkv, d] of a paged cache at `slots` (int64 [n]), dequantized when the
    cache is FP4 ("codes", "scales", "g") and read as they are when it is BF16 ("rows")."""
    if "rows" in cache:
        return cache["rows"][slots]
    codes = cache["codes"][slots]
    q = QTensor(codes, cache["scales"][slots].view(torch.float8_e4m3fn), cache["g"][slots], Format.NVFP4,
                torch.Size((*codes.shape[:-1], codes.shape[-1] * 2)))
    return dequantize(q, torch.bfloat16, backend=backend)


def _reference(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // next(iter(k_cache.values())).shape[1]
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = read_cache_rows(k_cache, slots, "torch").float().repeat_interleave(group, 1)  # [n, Hq, d]
        v = read_cache_rows(v_cache, slots, "torch").float().repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, -1)
        out[i] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _slots(tables_ptr, b, MAX_BLOCKS, t, ok, BLOCK_SIZE: tl.constexpr):
        """Cache slots (int64) of sequence b's tokens t."""
        block = tl.load(tables_ptr + b * MAX_BLOCKS + t // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        return block * BLOCK_SIZE + t % BLOCK_SIZE

    @triton.jit
    def _load_rows(codes_ptr, scales_ptr, g_ptr, slot, h, ok, HKV: tl.constexpr, D: tl.constexpr,
                   IS_FP4: tl.constexpr):
        """What the cache holds for KV head h at `slot` (int64 [T]): FP4 packed codes [T, D/2],
        scale bytes [T, D/16] and global scales [T]; or BF16 rows [T, D] (and two placeholders)."""
        row = slot * HKV + h
        if IS_FP4:
            packed = tl.load(codes_ptr + row[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :], mask=ok[:, None],
                             other=0)
            sb = tl.load(scales_ptr + row[:, None] * (D // 16) + tl.arange(0, D // 16)[None, :], mask=ok[:, None],
                         other=0)
            g = tl.load(g_ptr + row, mask=ok, other=1.0)
            return packed, sb, g
        else:  # a BF16 cache: codes_ptr holds the rows
            rows = tl.load(codes_ptr + row[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
            return rows, ok, ok

    @triton.jit
    def _halves(raw, T: tl.constexpr, D: tl.constexpr, IS_FP4: tl.constexpr, INTERPRET: tl.constexpr):
        """`_load_rows`' result as two BF16 tiles [T, D/2]: the even and the odd elements (a packed
        byte's two codes), FP4 dequantized as `dequantize`."""
        if IS_FP4:
            packed, sb, g = raw
            sb = tl.reshape(tl.broadcast_to(sb[:, :, None], [T, D // 16, 8]), [T, D // 2])  # each byte's scale
            return _dequant_halves(packed, sb, g[:, None], INTERPRET)
        else:
            rows, _, _ = raw
            return tl.split(tl.reshape(rows, [T, D // 2, 2]))

    @triton.jit
    def _seq_chunk(n, MIN_CHUNK: tl.constexpr, DOUBLINGS: tl.constexpr, SPLITS: tl.constexpr):
        """A sequence of n tokens' chunk: the smallest MIN_CHUNK * 2**i (i <= DOUBLINGS) with
        SPLITS chunks covering n."""
        chunk = n * 0 + MIN_CHUNK
        for _ in tl.static_range(DOUBLINGS):
            chunk = tl.where(chunk * SPLITS < n, chunk * 2, chunk)
        return chunk

    @triton.jit
    def _mma(a, b, INTERPRET: tl.constexpr, SMALL: tl.constexpr):
        """a @ b with BF16 operands and an FP32 result (the interpreter's BF16 dot is unreliable:
        there the BF16 values are multiplied as FP32, which is exact). SMALL (inner dim < 16, too
        short for an MMA): CUDA-core products."""
        if SMALL:
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        elif INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))

    @triton.jit
    def _split_kernel(q_ptr, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, tables_ptr, lens_ptr, part_o_ptr,
                      part_ml_ptr, MAX_BLOCKS, scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                      G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                      MIN_CHUNK: tl.constexpr, DOUBLINGS: tl.constexpr, SPLITS: tl.constexpr, IS_FP4: tl.constexpr,
                      INTERPRET: tl.constexpr, SMALL: tl.constexpr):
        """The G query heads of KV head h of sequence b (padded to G_PAD rows for the MMA) over
        the cached tokens [c * chunk, (c + 1) * chunk) (`_seq_chunk`): unnormalised output,
        running max and sum of the online softmax, in FP32. Chunks past the sequence's end write
        nothing.

        Loads run ahead of the arithmetic: block-table entries two tiles ahead, K/V one tile. (A
        plain loop left to Triton's software pipeline ran 1.19x slower at batch 64 / 8k on the
        H200, at its best num_stages.)"""
        b, h, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        n = tl.load(lens_ptr + b)
        chunk = _seq_chunk(n, MIN_CHUNK, DOUBLINGS, SPLITS)
        start = c * chunk
        if start >= n:
            return
        jh = tl.arange(0, D // 2)
        rg = tl.arange(0, G_PAD)
        g_ok = rg < G
        q_rows = q_ptr + (b * HQ + h * G + rg)[:, None] * D + 2 * jh[None, :]
        q_even = tl.load(q_rows, mask=g_ok[:, None], other=0.0)
        q_odd = tl.load(q_rows + 1, mask=g_ok[:, None], other=0.0)
        m_i = tl.full((G_PAD,), -float("inf"), dtype=tl.float32)
        l_i = tl.zeros((G_PAD,), dtype=tl.float32)
        acc_even = tl.zeros((G_PAD, D // 2), dtype=tl.float32)
        acc_odd = tl.zeros((G_PAD, D // 2), dtype=tl.float32)
        span = tl.minimum(n - start, chunk)  # tokens of this chunk
        i = tl.arange(0, BLOCK_T)
        ok = i < span
        slot = _slots(tables_ptr, b, MAX_BLOCKS, start + i, ok, BLOCK_SIZE)
        k_raw = _load_rows(kc_ptr, ks_ptr, kg_ptr, slot, h, ok, HKV, D, IS_FP4)
        v_raw = _load_rows(vc_ptr, vs_ptr, vg_ptr, slot, h, ok, HKV, D, IS_FP4)
        ok_next = i + BLOCK_T < span
        slot_next = _slots(tables_ptr, b, MAX_BLOCKS, start + BLOCK_T + i, ok_next, BLOCK_SIZE)
        # the interpreter (Triton 3.6) needs a Python loop bound; compiled kernels stop at the span
        for t0 in range(0, MIN_CHUNK * 2**DOUBLINGS if INTERPRET else span, BLOCK_T):
            ok_after = t0 + 2 * BLOCK_T + i < span
            slot_after = _slots(tables_ptr, b, MAX_BLOCKS, start + t0 + 2 * BLOCK_T + i, ok_after, BLOCK_SIZE)
            k_next = _load_rows(kc_ptr, ks_ptr, kg_ptr, slot_next, h, ok_next, HKV, D, IS_FP4)
            v_next = _load_rows(vc_ptr, vs_ptr, vg_ptr, slot_next, h, ok_next, HKV, D, IS_FP4)
            k_even, k_odd = _halves(k_raw, BLOCK_T, D, IS_FP4, INTERPRET)
            s = _mma(q_even, tl.trans(k_even), INTERPRET, SMALL) + _mma(q_odd, tl.trans(k_odd), INTERPRET, SMALL)
            s = tl.where(ok[None, :], s * scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v_even, v_odd = _halves(v_raw, BLOCK_T, D, IS_FP4, INTERPRET)
            acc_even = acc_even * alpha[:, None] + _mma(p, v_even, INTERPRET, SMALL)
            acc_odd = acc_odd * alpha[:, None] + _mma(p, v_odd, INTERPRET, SMALL)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            k_raw, v_raw, ok = k_next, v_next, ok_next
            slot_next, ok_next = slot_after, ok_after
        rows = (b * HQ + h * G + rg) * SPLITS + c
        o_rows = part_o_ptr + rows[:, None] * D + 2 * jh[None, :]
        tl.store(o_rows, acc_even, mask=g_ok[:, None])
        tl.store(o_rows + 1, acc_odd, mask=g_ok[:, None])
        tl.store(part_ml_ptr + rows * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + rows * 2 + 1, l_i, mask=g_ok)

    @triton.jit
    def _combine_kernel(part_o_ptr, part_ml_ptr, lens_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr,
                        MIN_CHUNK: tl.constexpr, DOUBLINGS: tl.constexpr, SPLITS: tl.constexpr,
                        SPLITS_PAD: tl.constexpr, INTERPRET: tl.constexpr):
        """out[b, hq] = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c over the chunks that ran."""
        b, hq = tl.program_id(0).to(tl.int64), tl.program_id(1)
        n = tl.load(lens_ptr + b)
        c = tl.arange(0, SPLITS_PAD)
        ran = c * _seq_chunk(n, MIN_CHUNK, DOUBLINGS, SPLITS) < n
        rows = (b * HQ + hq) * SPLITS + c
        m = tl.load(part_ml_ptr + rows * 2, mask=ran, other=-float("inf"))
        l_c = tl.load(part_ml_ptr + rows * 2 + 1, mask=ran, other=0.0)
        w = tl.where(ran, tl.exp(m - tl.max(m, 0)), 0.0)
        d = tl.arange(0, D)
        o = tl.load(part_o_ptr + rows[:, None] * D + d[None, :], mask=ran[:, None], other=0.0)
        o = tl.sum(w[:, None] * o, 0) / tl.sum(w * l_c, 0)
        tl.store(out_ptr + (b * HQ + hq) * D + d, _bf16_rne(o) if INTERPRET else o.to(tl.bfloat16))
