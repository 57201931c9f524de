"""Decode attention that reads K and V straight from a paged NVFP4 (or BF16) KV cache.

One query token per sequence attends over all its cached tokens. The cache holds, per token
slot and KV head, packed E2M1 codes [d/2], E4M3 block scales [d/16] and one FP32 global scale
(slot = block * block_size + offset; each sequence's blocks in its row of `block_tables`). The
Triton kernel dequantizes K and V tiles in registers (as `dequantize` does, then BF16) and runs
an online softmax in FP32; the torch reference gathers and dequantizes the rows, then computes
the same softmax attention.

Shapes: q [B, Hq, d] bf16, codes uint8 [S, Hkv, d/2], scales uint8 [S, Hkv, d/16] (E4M3 bits),
g float32 [S, Hkv, 1] (or a BF16 cache: rows [S, Hkv, d]), block_tables int32 [B, max_blocks],
seq_lens int32 [B]; out [B, Hq, d].
"""

from __future__ import annotations

import math

import torch

from .api import _use_triton, dequantize
from .formats import Format
from .qtensor import QTensor

try:
    import triton
    import triton.language as tl

    from .triton_fp4 import _bf16_rne, _e2m1_value, _e4m3_value, _interpreting
except ImportError:  # pragma: no cover
    triton = None


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size: int, *,
                           scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention of one query per sequence over its cached keys (GQA: query head h reads
    KV head h // (Hq / Hkv)). k_cache / v_cache: dicts with "codes", "scales", "g" (FP4) or
    "rows" (BF16)."""
    b, hq, d = q.shape
    fp4 = "codes" in k_cache
    hkv = (k_cache["codes"] if fp4 else k_cache["rows"]).shape[1]
    if hq % hkv or d % 16:
        raise ValueError(f"paged_decode_attention: {hq} query heads over {hkv} KV heads of dim {d}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not _use_triton(q, backend):
        return _reference(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale)
    out = torch.empty_like(q)
    kp = (k_cache["codes"], k_cache["scales"], k_cache["g"]) if fp4 else (k_cache["rows"],) * 3
    vp = (v_cache["codes"], v_cache["scales"], v_cache["g"]) if fp4 else (v_cache["rows"],) * 3
    group = hq // hkv
    _decode_kernel[(b, hkv)](  # one program per (sequence, KV head): its K/V are read once for the group
        q.contiguous(), *kp, *vp, block_tables, seq_lens, out, block_tables.shape[1], scale,
        HQ=hq, HKV=hkv, G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_SIZE=block_size,
        BLOCK_T=32, IS_FP4=fp4, INTERPRET=_interpreting(), num_warps=4,
        # the interpreter (Triton 3.6) needs a Python loop bound; compiled kernels loop to each length
        MAX_LEN=int(seq_lens.max()) if _interpreting() else 0,
    )
    return out


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
    def _dequant_rows(codes_ptr, scales_ptr, g_ptr, slot, h, ok, HKV: tl.constexpr, D: tl.constexpr,
                      BLOCK_T: tl.constexpr, IS_FP4: tl.constexpr, INTERPRET: tl.constexpr):
        """K or V rows [BLOCK_T, D] of KV head h at `slot` (int64 [BLOCK_T]), as float32 of BF16."""
        row = slot * HKV + h
        if IS_FP4:
            jh = tl.arange(0, D // 2)
            packed = tl.load(codes_ptr + row[:, None] * (D // 2) + jh[None, :], mask=ok[:, None], other=0)
            codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_T, D]).to(tl.int32)
            val = (_e2m1_value(codes & 7).to(tl.int32, bitcast=True) | ((codes & 8) << 28)).to(tl.float32,
                                                                                               bitcast=True)
            jb = tl.arange(0, D // 16)
            sb = tl.load(scales_ptr + row[:, None] * (D // 16) + jb[None, :], mask=ok[:, None], other=0).to(tl.int32)
            s = tl.reshape(tl.broadcast_to(_e4m3_value(sb)[:, :, None], [BLOCK_T, D // 16, 16]), [BLOCK_T, D])
            g = tl.load(g_ptr + row, mask=ok, other=1.0)
            x = (val * s) * g[:, None]
            out = (_bf16_rne(x) if INTERPRET else x.to(tl.bfloat16)).to(tl.float32)
        else:  # a BF16 cache: codes_ptr holds the rows
            out = tl.load(codes_ptr + row[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None],
                          other=0.0).to(tl.float32)
        return out

    @triton.jit
    def _decode_kernel(q_ptr, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, tables_ptr, lens_ptr, out_ptr,
                       MAX_BLOCKS, scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                       D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, IS_FP4: tl.constexpr,
                       INTERPRET: tl.constexpr, MAX_LEN: tl.constexpr):
        """The G query heads of KV head h of sequence b (padded to G_PAD rows for the MMA),
        online softmax over BLOCK_T cached tokens at a time."""
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        d = tl.arange(0, D)
        rg = tl.arange(0, G_PAD)
        g_ok = rg < G
        q_rows = (b * HQ + h * G + rg)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_rows, mask=g_ok[:, None], other=0.0)
        n = tl.load(lens_ptr + b)
        m_i = tl.full((G_PAD,), -float("inf"), dtype=tl.float32)
        l_i = tl.zeros((G_PAD,), dtype=tl.float32)
        acc = tl.zeros((G_PAD, D), dtype=tl.float32)
        for t0 in range(0, MAX_LEN if INTERPRET else n, BLOCK_T):  # blocks past n are fully masked
            t = t0 + tl.arange(0, BLOCK_T)
            ok = t < n
            block = tl.load(tables_ptr + b * MAX_BLOCKS + t // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            slot = block * BLOCK_SIZE + t % BLOCK_SIZE
            k = _dequant_rows(kc_ptr, ks_ptr, kg_ptr, slot, h, ok, HKV, D, BLOCK_T, IS_FP4, INTERPRET)
            v = _dequant_rows(vc_ptr, vs_ptr, vg_ptr, slot, h, ok, HKV, D, BLOCK_T, IS_FP4, INTERPRET)
            if D < 32:  # small heads: CUDA-core products (the MMA path gave wrong results at D=16 on H200)
                s = tl.sum(q.to(tl.float32)[:, None, :] * k[None, :, :], 2)
            elif INTERPRET:  # the interpreter's bf16 dot is unreliable; K and V are BF16 values in fp32
                s = tl.dot(q.to(tl.float32), tl.trans(k))
            else:
                s = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
            s = tl.where(ok[None, :], s * scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            if D < 32:
                pv = tl.sum(p[:, :, None] * v[None, :, :], 1)
            elif INTERPRET:
                pv = tl.dot(p, v)
            else:
                pv = tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + q_rows, _bf16_rne(o) if INTERPRET else o.to(tl.bfloat16), mask=g_ok[:, None])
