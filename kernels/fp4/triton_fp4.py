"""Triton kernels for FP4 quantize / dequantize, bit-identical to `reference.py`.

Each kernel repeats the reference's FP32 steps in the same order. Triton's default FP32
division is approximate, so every division is `tl.div_rn`; FMA contraction is switched off
at launch (`enable_fp_fusion=False`) so no product is fused into a following add. The
E4M3 rounding is done with integer and exact float operations instead of an fp8 cast, so
the same code runs under TRITON_INTERPRET=1 on the CPU (what CI tests) and on the GPU.

The tensor is viewed as NB = M*K/bs consecutive blocks; a program takes a [BLOCK_B, bs]
tile of them (contiguous in memory, so loads are wide and coalesced) and never needs to
know where rows start, except to find a block's global scale. Per-row scaling computes the
row amax in the same program when a program holds one whole row (G_ROW_AMAX); longer rows
get their amax from a torch reduction first and use the per-row path (G_ROW).
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .formats import Format, MXScaleRule
from .reference import nvfp4_global_scale

# How the kernel finds each block's global scale.
G_NONE, G_TENSOR, G_ROW, G_ROW_AMAX = 0, 1, 2, 3
# What the quantize kernel computes from its input before quantizing (fake quantization only).
PRE_NONE, PRE_RMS_NORM, PRE_SILU_MUL = 0, 1, 2
# Elements per program for the flat tiles; rows up to MAX_ROW_ELEMENTS get one program each.
TILE_ELEMENTS = 4096
MAX_ROW_ELEMENTS = 16384
# Row-per-program fake quantization (the FP4 sites' inputs) of at most FEW_ROWS rows (a decode
# batch: fewer programs than a few per multiprocessor) spreads each row over about a warp per
# 128 output elements, 4 to 16 warps, for more loads in flight per program: at batch 64 qkv's
# input 3.2 -> 2.9 us, fc1's 4.7 -> 3.8, fc2's 5.4 -> 4.7, proj's 3.3 -> 3.0
# (bench/results/decode_pass7_2026-12-01_h200.log). More rows keep 4 warps (8 from 4096 elements).
FEW_ROWS = 512


def _fake_row_warps(rows: int, row_elements: int) -> int:
    if rows <= FEW_ROWS:
        return min(16, max(4, triton.next_power_of_2(triton.cdiv(row_elements, 128))))
    return 8 if row_elements >= 4096 else 4


@triton.jit
def _hash32(x):
    # lowbias32 on uint32 (see rng.py); multiplication wraps mod 2**32.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform(index, key):
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    r = _hash32(lo ^ _hash32(hi ^ key))
    return (r >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _e2m1_codes(v, index, key, STOCHASTIC: tl.constexpr):
    """Unpacked E2M1 codes (uint8) of scaled float32 values, as reference.round_scaled_to_e2m1."""
    a = tl.minimum(tl.abs(v), 6.0)
    if STOCHASTIC:
        lo = (
            (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
            + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
            + (a >= 6.0).to(tl.int32)
        )
        lo_val = _e2m1_value(lo)
        step = tl.where(lo < 4, 0.5, tl.where(lo < 6, 1.0, 2.0))
        frac = tl.div_rn(a - lo_val, step)
        mag = lo + (_uniform(index, key) < frac).to(tl.int32)
    else:
        mag = _e2m1_magnitude_rne(a)
    sign = (v.to(tl.uint32, bitcast=True) >> 28) & 8
    return (mag | sign.to(tl.int32)).to(tl.uint8)


@triton.jit
def _e2m1_guided_codes(v, bits):
    """Guided E2M1 codes (uint8), as reference.round_guided_to_e2m1."""
    a = tl.minimum(tl.abs(v), 6.0)
    # Floor code: the nearest code, one lower when it lies above a.
    near = _e2m1_magnitude_rne(a)
    near_val = _e2m1_value(near)
    lo = near - (near_val > a).to(tl.int32)
    up = (((a > near_val) | (near_val > a)) & (lo < 7)) | (lo == 0)
    mag = tl.where((lo & 1) == bits, lo, tl.where(up, lo + 1, lo - 1))
    sign = (v.to(tl.uint32, bitcast=True) >> 28) & 8
    return (mag | sign.to(tl.int32)).to(tl.uint8)


@triton.jit
def _e2m1_value(mag):
    """float32 magnitude of codes 0..7 (int32) by placing bits: codes 2..7 are
    2**((m >> 1) - 1) * (1 + (m & 1) / 2), exponent field (m >> 1) + 126 and top mantissa
    bit m & 1; code 1 is 0.5 and 0 is 0."""
    bits = tl.where(mag < 2, mag * 0x3F000000, mag * 0x400000 + 0x3F000000)
    return bits.to(tl.float32, bitcast=True)


# Packed E2M1 codes and their E4M3 scale bytes -> e2m1 * s / 64 as float32, exactly, four bytes
# (eight elements) per call:
#   - A nibble's magnitude bits (exponent e, mantissa m) land in an E4M3 byte's low exponent and
#     top mantissa bits: 2**(e-7) * (1 + m/2) for e >= 1, the subnormal 2**-7 for code 1, so each
#     value / 64 exactly; the sign moves to bit 7. Four bytes per logic op.
#   - Hopper converts E4M3 pairs to f16x2 in one instruction, for the codes and for the scale.
#   - (e2m1 / 64) * s is exact in f16: at most 6 significant bits, a multiple of 2**-16 and at
#     most 42, so one f16x2 multiply per two elements; then f16 -> f32, also exact.
# $8: four packed bytes; $9: their scale byte (the same for all four: a 16-element block holds
# eight bytes, and a group of four starts at a multiple of four).
_E2M1_HALVES_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, t, s2, f0, f1, f2, f3;
.reg .b16 l0, l1, h0, h1, x0, x1;
mov.b32 {x0, x1}, $9;
cvt.rn.f16x2.e4m3x2 s2, x0;
and.b32 lo, $8, 0x07070707;
shl.b32 lo, lo, 2;
and.b32 t, $8, 0x08080808;
shl.b32 t, t, 4;
or.b32 lo, lo, t;
shr.b32 hi, $8, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, $8, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 f0, l0;
cvt.rn.f16x2.e4m3x2 f1, l1;
cvt.rn.f16x2.e4m3x2 f2, h0;
cvt.rn.f16x2.e4m3x2 f3, h1;
mul.rn.f16x2 f0, f0, s2;
mul.rn.f16x2 f1, f1, s2;
mul.rn.f16x2 f2, f2, s2;
mul.rn.f16x2 f3, f3, s2;
mov.b32 {x0, x1}, f0;
cvt.f32.f16 $0, x0;
cvt.f32.f16 $1, x1;
mov.b32 {x0, x1}, f1;
cvt.f32.f16 $2, x0;
cvt.f32.f16 $3, x1;
mov.b32 {x0, x1}, f2;
cvt.f32.f16 $4, x0;
cvt.f32.f16 $5, x1;
mov.b32 {x0, x1}, f3;
cvt.f32.f16 $6, x0;
cvt.f32.f16 $7, x1;
}
""")


@triton.jit
def _dequant_halves(packed, sb, g, INTERPRET: tl.constexpr):
    """`dequantize`'s BF16 values, (e2m1 * s) * g rounded once to FP32 then to BF16, of the even
    and the odd elements of packed NVFP4 rows (element 2j in byte j's low nibble, 2j + 1 in its
    high nibble): two tiles shaped like `packed`.

    packed: uint8 [R, C]; sb: each byte's E4M3 scale byte, uint8 [R, C]; g: float32,
    broadcastable to [R, C]. The product (e2m1 * s / 64) * (64 * g) is the same exact real
    number as (e2m1 * s) * g, so it rounds to the same FP32 value (64 * g cannot overflow:
    g = amax / 2688 <= 1.3e35).
    """
    if INTERPRET:
        s = _e4m3_value(sb.to(tl.int32)) * 0.015625
        even = _e2m1_signed(packed.to(tl.int32) & 0xF) * s
        odd = _e2m1_signed(packed.to(tl.int32) >> 4) * s
    else:
        even, odd = tl.inline_asm_elementwise(_E2M1_HALVES_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [packed, sb],
                                              dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    g64 = g * 64.0
    even, odd = even * g64, odd * g64
    if INTERPRET:  # the interpreter's .to(bfloat16) truncates
        return _bf16_rne(even), _bf16_rne(odd)
    else:
        return even.to(tl.bfloat16), odd.to(tl.bfloat16)


@triton.jit
def _e2m1_signed(code):
    """float32 value of E2M1 codes 0..15 (int32), the sign by bit, so code 8 decodes to -0.0."""
    return (_e2m1_value(code & 7).to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(sb):
    """float32 value of E4M3 scale bytes (int32, positive codes 0..126)."""
    normal = (((sb >> 3) - 7 + 127) << 23 | ((sb & 7) << 20)).to(tl.float32, bitcast=True)
    return tl.where(sb >= 8, normal, (sb & 7).to(tl.float32) * 0.001953125)


@triton.jit
def _e2m1_magnitude_rne(a):
    """E2M1 magnitude code (int32 0..7) of a in [0, 6], RNE, with float adds instead of compares.

    The grid step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]: p, the power of two at or below
    max(a, 1), is 1, 2 or 4, and adding C = p * 2**22 (whose ulp is the step) rounds a to the
    grid, ties to an even multiple of the step, which is the even code. The code is then
    read from the rounded value's bits: (bits >> 22) - 252 for r >= 1 (exponent and top
    mantissa bit), 1 for r = 0.5, 0 for r = 0.
    """
    p = (tl.maximum(a, 1.0).to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    c = p * 4194304.0
    r = (a + c) - c
    code = (r.to(tl.int32, bitcast=True) >> 22) - 252 + (r < 1.0).to(tl.int32)
    return tl.maximum(code, 0)


@triton.jit
def _e4m3_round(v):
    """RNE of positive float32 v in [2**-9, 448] to E4M3: (value as float32, byte as int32)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    # Quantum 2**(e-3) for normal E4M3 (3 mantissa bits), 2**-9 for its subnormals. Adding
    # C = quantum * 2**23 leaves exactly the bits above the quantum; the add rounds RNE.
    q_exp = tl.maximum(exp - 127 - 3, -9)
    c = ((q_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (v + c) - c
    r_bits = r.to(tl.int32, bitcast=True)
    r_exp = (r_bits >> 23) & 0xFF
    normal_byte = ((r_exp - 127 + 7) << 3) | ((r_bits >> 20) & 7)
    sub_byte = (r * 512.0).to(tl.int32)
    return r, tl.where(r < 0.015625, sub_byte, normal_byte)


@triton.jit
def _mx_exponent(block_amax, CEIL_RULE: tl.constexpr):
    """Unbiased E8M0 exponent of each block, as reference.mxfp4_block_exponents."""
    if CEIL_RULE:
        a = tl.div_rn(block_amax, 6.0)
    else:
        a = block_amax
    bits = a.to(tl.int32, bitcast=True)
    exp_field = (bits >> 23) & 0xFF
    if CEIL_RULE:
        e_normal = exp_field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        e_sub = tl.where(bits > 0x400000, -126, -127)
        e = tl.where(exp_field == 0, e_sub, e_normal)
    else:
        e = tl.where(exp_field == 0, -125, exp_field - 127) - 2
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(block_amax == 0, 0, e)


@triton.jit
def _pow2(e):
    """2.0**e as float32 for integer e in [-127, 127] (2**-127 is the subnormal 0x400000)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e == -127, tl.full(e.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True), normal)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_global_scale(row_amax):
    """Row-scaled NVFP4's global scale of rows with this amax (float32): amax / (6 * 448), 1 for
    an all-zero row (reference.nvfp4_global_scale)."""
    g = tl.div_rn(row_amax, 2688.0)
    return tl.where(g == 0, 1.0, g)


@triton.jit
def _nvfp4_block_scales(block_amax, g):
    """(E4M3 block scales as float32, their bytes as int32) of NVFP4 blocks with these amaxes
    under global scale g: amax / (6 g) clamped to E4M3's range and rounded; 1.0 (byte 0x38) for
    an all-zero block."""
    s = tl.minimum(tl.maximum(tl.div_rn(block_amax, 6.0 * g), 0.001953125), 448.0)
    s, scale_byte = _e4m3_round(s)
    zero_block = block_amax == 0
    return tl.where(zero_block, 1.0, s), tl.where(zero_block, 0x38, scale_byte)


@triton.jit
def _nvfp4_block_scale_bytes_guided(block_amax, g, lsb):
    """E4M3 bytes (int32) of `reference.nvfp4_block_scales_guided`: the code nearest to
    amax / (6 g), clamped to [2**-9, 448], whose last bit is lsb (int32 0/1); 0x38 (1.0) for an
    all-zero block."""
    r = tl.minimum(tl.maximum(tl.div_rn(block_amax, 6.0 * g), 0.001953125), 448.0)
    near, b = _e4m3_round(r)
    lo = tl.where(near > r, b - 1, b)
    up = ((r > _e4m3_value(lo)) & (lo < 0x7E)) | (lo == 1)  # code 1 (2**-9) is the floor of the clamp
    code = tl.where((lo & 1) == lsb, lo, tl.where(up, lo + 1, lo - 1))
    return tl.where(block_amax == 0, 0x38, code)


@triton.jit
def _pack_pairs(codes):
    """E2M1 codes uint8 [R, C] -> packed bytes [R, C / 2]: element 2j in byte j's low nibble."""
    even, odd = tl.split(tl.reshape(codes, [codes.shape[0], codes.shape[1] // 2, 2]))
    return even | (odd << 4)


@triton.jit(do_not_specialize=["NB", "BPR", "key", "XS0", "XS1"])
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, bad_ptr, bits_ptr, NB, BPR, key, slots_ptr, XS0, XS1,
    IS_MX: tl.constexpr, G_MODE: tl.constexpr, STOCHASTIC: tl.constexpr, CEIL_RULE: tl.constexpr,
    GUIDED: tl.constexpr, BS: tl.constexpr, BLOCK_B: tl.constexpr,
    FAKE: tl.constexpr = False, BITS_OUT: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    HEADS: tl.constexpr = 0, PRE: tl.constexpr = 0, pre_w_ptr=None, pre_out_ptr=None, eps=0.0,
    PARTS: tl.constexpr = 0, RESIDUAL: tl.constexpr = False, res_ptr=None, sum_out_ptr=None,
):
    """Quantize NB blocks of BS elements; BPR blocks per row. One [BLOCK_B, BS] tile per program.

    GUIDED (NVFP4, G_ROW): block scales are read from scales_ptr instead of computed, and each
    element takes the code nearest to it whose mantissa bit is the one in bits_ptr.
    FAKE (NVFP4, per-row g): codes_ptr receives the dequantized values, (e2m1 * s) * g in its
    dtype, instead of packed codes: fake quantization in one pass. BITS_OUT: bits_ptr receives
    each element's mantissa bit (code & 1), eight per byte, what guidance records keep.
    HEADS > 0 (G_ROW_AMAX, packed codes): rows are (token, head) of an [n, HEADS, K] view with
    strides (XS0, XS1, 1), and row (t, h) is written to output row slots_ptr[t] * HEADS + h (a
    paged KV cache's slot), its g to g_ptr at that row.
    PRE (G_ROW_AMAX, FAKE) computes the rows before quantizing them, and writes them to
    pre_out_ptr [rows, K] bf16: PRE_RMS_NORM, RMSNorm of x with weight pre_w_ptr (float32 [K]);
    PRE_SILU_MUL, bf16(silu(gate)) * up of x = [gate | up] rows (row stride XS0). Each as the
    torch code rounds it (`_rms_norm_row`, `_silu_mul`).
    PRE_RMS_NORM's x may itself be a sum, written to sum_out_ptr [rows, K] bf16: PARTS > 0, x_ptr
    holds that many FP32 partial products [PARTS, rows, K] of a split-K GEMM, added in order and
    rounded to BF16 (linear.sum_parts); RESIDUAL, then plus res_ptr's bf16 rows (torch's BF16 add).
    """
    pid = tl.program_id(0).to(tl.int64)
    key = key.to(tl.uint32)
    if G_MODE == 3:  # G_ROW_AMAX: this program is row `pid`
        b_idx = pid * BPR + tl.arange(0, BLOCK_B)
        b_mask = tl.arange(0, BLOCK_B) < BPR
    else:
        b_idx = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        b_mask = b_idx < NB
    j = tl.arange(0, BS)
    offs = b_idx[:, None] * BS + j[None, :]
    mask = b_mask[:, None]
    out_row = pid
    if HEADS > 0:
        token, head = pid // HEADS, pid % HEADS
        offs = token * XS0 + head * XS1 + tl.arange(0, BLOCK_B)[:, None] * BS + j[None, :]
        out_row = tl.load(slots_ptr + token).to(tl.int64) * HEADS + head
        b_idx = out_row * BPR + tl.arange(0, BLOCK_B)
    if PRE == 2:  # PRE_SILU_MUL: gate in columns [0, K), up in [K, 2K)
        src = pid * XS0 + tl.arange(0, BLOCK_B)[:, None] * BS + j[None, :]
        gate = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + src + BPR * BS, mask=mask, other=0.0).to(tl.float32)
        x = _silu_mul(gate, up, INTERPRET).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 0:
        for z in tl.static_range(1, PARTS):
            x += tl.load(x_ptr + z * (NB * BS).to(tl.int64) + offs, mask=mask, other=0.0)
        x = _bf16(x, INTERPRET).to(tl.float32)
    if RESIDUAL:
        x = _bf16(x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32), INTERPRET).to(tl.float32)
    if PARTS > 0 or RESIDUAL:
        tl.store(sum_out_ptr + offs, x.to(tl.bfloat16), mask=mask)
    if PRE == 1:  # PRE_RMS_NORM: the program holds the whole row
        w = tl.load(pre_w_ptr + tl.arange(0, BLOCK_B)[:, None] * BS + j[None, :], mask=mask, other=0.0)
        inv_n = tl.div_rn(1.0, (BPR * BS).to(tl.float32))
        x = _rms_norm_row(x, w, tl.sum(tl.sum(x * x, 1), 0), eps, inv_n, INTERPRET).to(tl.float32)
    if PRE > 0:  # x holds BF16 values: the cast is exact (the interpreter's truncation too)
        tl.store(pre_out_ptr + offs, x.to(tl.bfloat16), mask=mask)
    # NaN-propagating block max: one finiteness test per block, not per element.
    block_amax = tl.reduce(tl.abs(x), 1, _max_propagate_nan)
    bad = tl.max((~(block_amax <= 3.4028234663852886e38)).to(tl.int32), axis=0)
    tl.store(bad_ptr + pid, bad.to(tl.uint8))

    if IS_MX:
        e = _mx_exponent(block_amax, CEIL_RULE)
        u = _pow2(e)
        scale_byte = e + 127
    else:
        if G_MODE == 1:
            g = tl.load(g_ptr)
        elif G_MODE == 2:
            g = tl.load(g_ptr + b_idx // BPR, mask=b_mask, other=1.0)
        else:
            g = _row_global_scale(tl.reduce(block_amax, 0, _max_propagate_nan))
            tl.store(g_ptr + out_row, g)
        if GUIDED:
            s = _e4m3_value(tl.load(scales_ptr + b_idx, mask=b_mask, other=0x38).to(tl.int32))
        else:
            s, scale_byte = _nvfp4_block_scales(block_amax, g)
        u = s * g
    v = tl.div_rn(x, u[:, None])
    if GUIDED:
        # A block's 16 bits are its two bytes (element i in bit i % 8 of byte i // 8): load
        # them once per block as a 16-bit word, then shift per element.
        two = tl.load(bits_ptr + b_idx[:, None] * 2 + tl.arange(0, 2)[None, :], mask=mask, other=0).to(tl.int32)
        word = tl.sum(two << (8 * tl.arange(0, 2))[None, :], axis=1)
        codes = _e2m1_guided_codes(v, (word[:, None] >> j[None, :]) & 1)
    else:
        codes = _e2m1_codes(v, offs, key, STOCHASTIC)
    if FAKE:
        c = codes.to(tl.int32)
        out = (_e2m1_signed(c) * s[:, None]) * (g + tl.zeros([BLOCK_B], tl.float32))[:, None]  # as _dequantize_kernel
        if INTERPRET and codes_ptr.dtype.element_ty == tl.bfloat16:
            out = _bf16_rne(out)
        else:
            out = out.to(codes_ptr.dtype.element_ty)
        tl.store(codes_ptr + offs, out, mask=mask)
    else:
        jh = tl.arange(0, BS // 2)
        tl.store(codes_ptr + b_idx[:, None] * (BS // 2) + jh[None, :], _pack_pairs(codes), mask=mask)
    if BITS_OUT:  # element i of a block in bit i % 8 of its byte i // 8, as packing.pack_bits
        lsb = tl.reshape((codes & 1).to(tl.int32), [BLOCK_B, BS // 8, 8])
        packed_bits = tl.sum(lsb << tl.arange(0, 8)[None, None, :], axis=2)
        jb = tl.arange(0, BS // 8)
        tl.store(bits_ptr + b_idx[:, None] * (BS // 8) + jb[None, :], packed_bits.to(tl.uint8), mask=mask)
    if not GUIDED:
        tl.store(scales_ptr + b_idx, scale_byte.to(tl.uint8), mask=b_mask)


@triton.jit
def _bf16(x, INTERPRET: tl.constexpr):
    """x (float32) rounded to BF16 to nearest even (the interpreter's cast truncates)."""
    if INTERPRET:
        return _bf16_rne(x)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _rms_norm_row(x, w, ss, eps, inv_n, INTERPRET: tl.constexpr):
    """F.rms_norm of one row held whole by the program, as torch's composite computes it in
    FP32: bf16(fl32(x * r) * w), r = rsqrt(ss * inv_n + eps) (mean, then + eps: launch with
    enable_fp_fusion=False). x float32 of BF16 values (any tile shape, zero where masked), w
    float32 of x's shape, ss the sum of x * x, inv_n = fl32(1 / row length)."""
    r = tl.math.rsqrt(ss * inv_n + eps)
    return _bf16(x * r * w, INTERPRET)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    """expf as CUDA C++ (and so torch) computes it: libdevice's, not tl.exp's ex2.approx. The
    interpreter has no libdevice; there it is numpy's exp."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _silu_mul(gate, up, INTERPRET: tl.constexpr):
    """F.silu(gate) * up on BF16 tensors as torch computes them (gate, up float32 holding BF16
    values): silu = gate / (1 + exp(-gate)) in FP32 (libdevice exp, IEEE division) rounded to
    BF16, then the product in FP32 rounded to BF16."""
    s = _bf16(tl.div_rn(gate, 1.0 + _exp(-gate, INTERPRET)), INTERPRET).to(tl.float32)
    return _bf16(s * up, INTERPRET)


@triton.jit
def _bf16_rne(x):
    """float32 -> bfloat16, round to nearest even, by integer ops (finite x).

    Used under the interpreter only, whose `.to(tl.bfloat16)` truncates; GPUs round to nearest
    even in hardware (cvt.rn.bf16.f32), which the GPU tests compare with torch bit for bit.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit(do_not_specialize=["NB", "BPR"])
def _dequantize_kernel(
    codes_ptr, scales_ptr, g_ptr, out_ptr, NB, BPR,
    IS_MX: tl.constexpr, G_MODE: tl.constexpr, BS: tl.constexpr, BLOCK_B: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """value = (e2m1(code) * scale) * g for NB blocks, one [BLOCK_B, BS] tile per program."""
    pid = tl.program_id(0).to(tl.int64)
    b_idx = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = b_idx < NB
    jh = tl.arange(0, BS // 2)
    packed = tl.load(codes_ptr + b_idx[:, None] * (BS // 2) + jh[None, :], mask=b_mask[:, None], other=0)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_B, BS]).to(tl.int32)
    val = _e2m1_signed(codes)
    sb = tl.load(scales_ptr + b_idx, mask=b_mask, other=0).to(tl.int32)
    if IS_MX:
        out = val * _pow2(sb - 127)[:, None]
    else:
        s = _e4m3_value(sb)
        if G_MODE == 1:
            g = tl.load(g_ptr)
        else:
            g = tl.load(g_ptr + b_idx // BPR, mask=b_mask, other=1.0)[:, None]
        out = (val * s[:, None]) * g
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        out = _bf16_rne(out)
    else:
        out = out.to(out_ptr.dtype.element_ty)
    j = tl.arange(0, BS)
    tl.store(out_ptr + b_idx[:, None] * BS + j[None, :], out, mask=b_mask[:, None])


# ---------------------------------------------------------------------------------------------
# BF16 input, round to nearest or guided: E2M1 codes by exact comparisons, no per-element division.
#
# The spec's code is a function of v = fl(|x| / u) (u = s * g, one FP32 value per block) through
# seven comparisons with the grid's midpoints T (formats.e2m1_magnitude_code_rne: > 0.25, >= 0.75,
# > 1.25, >= 1.75, > 2.5, >= 3.5, > 5). With q = |x| / u exact, and every T having an even last
# significand bit:
#     fl(q) >= T  <=>  q >= T - ulp-below(T) / 2   (the midpoint below T rounds to T)
#     fl(q) >  T  <=>  q >  T + ulp(T) / 2         (the midpoint above T rounds to T)
# So each decision is q against m = T -+ 2**(E-24) (T in [2**E, 2**(E+1))): |x| against m * u.
# m * 2**(24-E) is an odd integer of 25 bits, so m * u (u > 0 an FP32 value of at most 24
# significant bits) has an odd part of at least 25 bits: it is never an FP32 (or BF16) number,
# ties cannot occur, and |x| >= m * u  <=>  |x| >= C = RU_bf16(m * u), the least BF16 above it.
# m * u is exact in FP64 (25 + 24 bits); RU_bf16 of it is its FP32 truncation's top 16 bits
# plus one (it is not on the BF16 grid), which also gives +inf above the BF16 range and the
# least subnormal below it. Per element that leaves seven packed BF16 comparisons of |x| with
# per-block thresholds, two elements per instruction. u = 0 (an underflowed s * g) gives C =
# 2**-133 (x / 0 is +-inf: code 7); NaN u gives NaN thresholds (every comparison false, code 0,
# as NaN v in the reference).
# Guided rounding (reference.round_guided_to_e2m1) reduces to strict comparisons too: mantissa
# bit 0 gives code 2 * #{|v| > 0.5, 1.5, 3}, bit 1 gives 1 + 2 * #{|v| > 1, 2, 4}.
# tests/kernels/fp4/test_thresholds.py checks the thresholds against FP32 division, and the GPU
# path (packed BF16 instructions) is checked bit for bit by bench/fp4_quantize.py's self-check.

# FP64 bit patterns of the midpoints m (exact: 25 significant bits).
def _f64_bits(v: float) -> tl.constexpr:
    return tl.constexpr(struct.unpack("<q", struct.pack("<d", v))[0])


_MR1, _MR2, _MR3, _MR4, _MR5, _MR6, _MR7 = (_f64_bits(v) for v in (  # RNE: > 0.25, >= 0.75, ..., > 5
    0.25 + 2.0**-26, 0.75 - 2.0**-25, 1.25 + 2.0**-24, 1.75 - 2.0**-24, 2.5 + 2.0**-23, 3.5 - 2.0**-23, 5.0 + 2.0**-22))
_MG1, _MG2, _MG3, _MG4, _MG5, _MG6 = (_f64_bits(v) for v in (  # guided: > 0.5, 1.5, 3 (bit 0), > 1, 2, 4 (bit 1)
    0.5 + 2.0**-25, 1.5 + 2.0**-24, 3.0 + 2.0**-23, 1.0 + 2.0**-24, 2.0 + 2.0**-23, 4.0 + 2.0**-22))


@triton.jit
def _bf16_threshold(u64, M_BITS: tl.constexpr, INTERPRET: tl.constexpr):
    """RU_bf16(m * u) for u64 = float64(u), m the float64 with bits M_BITS, as BF16 bits in both
    halves of an int32 (bf16x2), for positive u (see above)."""
    c = u64 * tl.full([1], M_BITS, tl.int64).to(tl.float64, bitcast=True)
    if INTERPRET:  # RN, then one step down where it rounded up: RZ for positive c
        f = c.to(tl.float32)
        bits = f.to(tl.int32, bitcast=True) - (f.to(tl.float64) > c).to(tl.int32)
    else:
        bits = tl.inline_asm_elementwise("cvt.rz.f32.f64 $0, $1;", "=r,d", [c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return ((bits >> 16) + 1) * 0x10001


@triton.jit
def _rne_thresholds(u, INTERPRET: tl.constexpr):
    u64 = u.to(tl.float64)
    return (_bf16_threshold(u64, _MR1, INTERPRET), _bf16_threshold(u64, _MR2, INTERPRET),
            _bf16_threshold(u64, _MR3, INTERPRET), _bf16_threshold(u64, _MR4, INTERPRET),
            _bf16_threshold(u64, _MR5, INTERPRET), _bf16_threshold(u64, _MR6, INTERPRET),
            _bf16_threshold(u64, _MR7, INTERPRET))


@triton.jit
def _guided_thresholds(u, INTERPRET: tl.constexpr):
    u64 = u.to(tl.float64)
    return (_bf16_threshold(u64, _MG1, INTERPRET), _bf16_threshold(u64, _MG2, INTERPRET),
            _bf16_threshold(u64, _MG3, INTERPRET), _bf16_threshold(u64, _MG4, INTERPRET),
            _bf16_threshold(u64, _MG5, INTERPRET), _bf16_threshold(u64, _MG6, INTERPRET))


def _pairs_asm(guided: bool) -> str:
    """PTX for four int32 words of BF16 pairs -> four bytes of packed codes (pack=4).

    Operands: $0 the four code bytes; $1..$4 the pairs; then one bf16x2 threshold per pair for
    each threshold (RNE: t1..t7; guided: A1..A3 for mantissa bit 0, B1..B3 for bit 1, then the
    pair's two guidance bits, bit 0 for the low element). A count of passed thresholds is kept
    in each half of a bf16x2 accumulator, 2 + n/64 (low half) and 2 + n/4 (high half), so
    that its bytes 0 and 2 hold n and n << 4; the sign bits then join by byte permutes."""
    n_t = 6 if guided else 7
    lines = [
        "{",
        ".reg .b32 a, c, t, m, k, base, acc<4>, mm<2>, ss<2>, lo, hi;",
        "mov.b32 base, 0x40004000;",
        f"mov.b32 k, {'0x3F003D00' if guided else '0x3E803C80'};",
    ]
    for i in range(4):
        x = f"${1 + i}"
        th = [f"${5 + 4 * q + i}" for q in range(n_t)]
        lines.append(f"and.b32 a, {x}, 0x7FFF7FFF;")
        acc = "base"
        if guided:
            bits = f"${5 + 4 * n_t + i}"
            lines += [f"mul.lo.u32 t, {bits}, 0x4080;", "prmt.b32 m, t, t, 0x9988;"]
            for q in range(3):  # the threshold for each half: m ? B : A
                lines += [f"lop3.b32 t, {th[q]}, {th[q + 3]}, m, 0xD8;",
                          "set.ge.bf16x2.bf16x2 c, a, t;", f"fma.rn.bf16x2 acc{i}, c, k, {acc};"]
                acc = f"acc{i}"
            lines.append(f"lop3.b32 acc{i}, acc{i}, m, 0x00100001, 0xF8;")  # the bit: code 2n + bit
        else:
            for q in range(n_t):
                lines += [f"set.ge.bf16x2.bf16x2 c, a, {th[q]};", f"fma.rn.bf16x2 acc{i}, c, k, {acc};"]
                acc = f"acc{i}"
    for h in range(2):
        lines += [f"prmt.b32 mm{h}, acc{2 * h}, acc{2 * h + 1}, 0x6420;",
                  f"prmt.b32 ss{h}, ${1 + 2 * h}, ${2 + 2 * h}, 0xFDB9;",
                  f"lop3.b32 mm{h}, mm{h}, ss{h}, 0x80088008, 0xD8;"]
    lines += ["prmt.b32 lo, mm0, mm1, 0x6420;", "prmt.b32 hi, mm0, mm1, 0x7531;", "or.b32 $0, lo, hi;", "}"]
    return "\n".join(lines)


_RNE_PAIRS_ASM = tl.constexpr(_pairs_asm(False))
_GUIDED_PAIRS_ASM = tl.constexpr(_pairs_asm(True))
_RNE_PAIRS_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 32))
_GUIDED_PAIRS_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 32))


@triton.jit
def _lane_count(a, t, SHIFT: tl.constexpr):
    """Interpreter twin of set.ge.bf16x2 on one half: |x| bits a (int32 of 15 bits) >= threshold
    bits, false where either is NaN."""
    ta = (t >> SHIFT) & 0xFFFF
    return ((a >= ta) & (a <= 0x7F80) & (ta <= 0x7F80)).to(tl.int32)


@triton.jit
def _pair_byte_interp(x, n_lo, n_hi):
    """Packed byte of a BF16 pair from the magnitude codes of its halves and x's sign bits."""
    s_lo = (x >> 15) & 1
    s_hi = (x >> 31) & 1
    return (n_lo | (s_lo << 3) | (n_hi << 4) | (s_hi << 7)).to(tl.uint8)


@triton.jit
def _rne_pair_codes(x, t1, t2, t3, t4, t5, t6, t7, INTERPRET: tl.constexpr):
    """Packed RNE codes (uint8) of int32 words of BF16 pairs, thresholds t1..t7 (bf16x2)."""
    if INTERPRET:
        lo = x & 0x7FFF
        hi = (x >> 16) & 0x7FFF
        n_lo = (_lane_count(lo, t1, 0) + _lane_count(lo, t2, 0) + _lane_count(lo, t3, 0) + _lane_count(lo, t4, 0)
                + _lane_count(lo, t5, 0) + _lane_count(lo, t6, 0) + _lane_count(lo, t7, 0))
        n_hi = (_lane_count(hi, t1, 16) + _lane_count(hi, t2, 16) + _lane_count(hi, t3, 16) + _lane_count(hi, t4, 16)
                + _lane_count(hi, t5, 16) + _lane_count(hi, t6, 16) + _lane_count(hi, t7, 16))
        return _pair_byte_interp(x, n_lo, n_hi)
    else:
        return tl.inline_asm_elementwise(_RNE_PAIRS_ASM, _RNE_PAIRS_CONSTRAINTS, [x, t1, t2, t3, t4, t5, t6, t7],
                                         dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _guided_pair_codes(x, a1, a2, a3, b1, b2, b3, bits, INTERPRET: tl.constexpr):
    """Packed guided codes (uint8) of int32 words of BF16 pairs: thresholds a* for mantissa bit 0,
    b* for bit 1 (bf16x2); bits: the pair's two guidance bits (int32 0..3, low element in bit 0)."""
    if INTERPRET:
        lo = x & 0x7FFF
        hi = (x >> 16) & 0x7FFF
        g_lo = bits & 1
        g_hi = (bits >> 1) & 1
        n_lo = tl.where(g_lo == 1, _lane_count(lo, b1, 0) + _lane_count(lo, b2, 0) + _lane_count(lo, b3, 0),
                        _lane_count(lo, a1, 0) + _lane_count(lo, a2, 0) + _lane_count(lo, a3, 0))
        n_hi = tl.where(g_hi == 1, _lane_count(hi, b1, 16) + _lane_count(hi, b2, 16) + _lane_count(hi, b3, 16),
                        _lane_count(hi, a1, 16) + _lane_count(hi, a2, 16) + _lane_count(hi, a3, 16))
        return _pair_byte_interp(x, 2 * n_lo + g_lo, 2 * n_hi + g_hi)
    else:
        return tl.inline_asm_elementwise(_GUIDED_PAIRS_ASM, _GUIDED_PAIRS_CONSTRAINTS,
                                         [x, a1, a2, a3, b1, b2, b3, bits], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _bf16_bits(v, INTERPRET: tl.constexpr):
    """BF16 bits (uint32, 0..0xFFFF) of float32 v rounded to nearest even, as `_bf16_rne` (the
    interpreter) and the hardware cast (the GPU) round dequantize's output."""
    if INTERPRET:
        bits = v.to(tl.uint32, bitcast=True)
        return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    else:
        return v.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _dequant_pair(codes, s, g, INTERPRET: tl.constexpr):
    """BF16 pairs (int32 words) of packed code bytes (uint8), as `_dequantize_kernel`:
    bf16((e2m1 * s) * g), the low nibble in the low half. s, g: float32 broadcastable."""
    c = codes.to(tl.int32)
    lo = _bf16_bits((_e2m1_signed(c & 0xF) * s) * g, INTERPRET)
    hi = _bf16_bits((_e2m1_signed(c >> 4) * s) * g, INTERPRET)
    return (lo | (hi << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _inside_pair(x, bound):
    """`ste_mask` of int32 words of BF16 pairs: |x| < bound (float32; false for NaN on either
    side, as torch's compare), as two bool bytes in an int16, the low element in the low byte."""
    a_lo = ((x & 0x7FFF) << 16).to(tl.float32, bitcast=True)
    a_hi = (x & 0x7FFF0000).to(tl.float32, bitcast=True)
    return ((a_lo < bound).to(tl.int32) | ((a_hi < bound).to(tl.int32) << 8)).to(tl.int16)


@triton.jit
def _max_u16x2(a, b):
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_lanes(a, b):
    """Lane-wise max of two int32 words of 15-bit halves, in plain integer ops (interpreter)."""
    return tl.maximum(a & 0xFFFF, b & 0xFFFF) | (tl.maximum(a >> 16, b >> 16) << 16)


@triton.jit(do_not_specialize=["NB", "BPR"])
def _quantize_bf16_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, bad_ptr, bits_ptr, NB, BPR,
    G_MODE: tl.constexpr, GUIDED: tl.constexpr, ROW_PROGRAM: tl.constexpr, BLOCK_B: tl.constexpr,
    INTERPRET: tl.constexpr, FAKE: tl.constexpr = False, MASK_OUT: tl.constexpr = False, mask_ptr=None,
    SCALE_RULE: tl.constexpr = 0, BITS_KNOWN: tl.constexpr = False, scale_known_ptr=None, known_ptr=None,
    scales_out_ptr=None, CLIP_OUT: tl.constexpr = False, clip_ptr=None,
):
    """Row- or tensor-scaled NVFP4 (RNE) or guided codes of BF16 rows, the same values as
    `_quantize_kernel`, by threshold comparisons (see above).

    x_ptr: int32 words of BF16 pairs, [NB, 8]. Each program takes BLOCK_B blocks, one row when
    ROW_PROGRAM (BPR blocks); a thread holds whole blocks (two [BLOCK_B, 4] word tiles, one per
    half block), so per-block work (scales, thresholds) is done once per block. G_MODE as
    `_quantize_kernel` (G_ROW_AMAX needs ROW_PROGRAM). GUIDED: block scale bytes from
    scales_ptr, the mantissa bits from bits_ptr (int16: one word per block), g per row.
    FAKE: codes_ptr (int32 words of BF16 pairs, [NB, 8]) receives the dequantized values instead
    of packed codes, as `dequantize(q, torch.bfloat16)`: fake quantization in one pass. MASK_OUT
    (with FAKE): mask_ptr (int16 words of two bool bytes, [NB, 8]) receives `ste_mask`, |x| <
    7 * (s * g), s the stored scale byte's value. CLIP_OUT (with FAKE): clip_ptr (uint8, one per
    program) receives whether any of the program's elements is outside that bound, so that whether
    the mask is all true is known without writing it or another pass over it.
    Partial guidance (GUIDED; sparse records, `partial_guidance.resolve_partial` in torch):
    SCALE_RULE 1: each block's own scale, rounded to the E4M3 code whose last bit is the one of
    the byte at scales_ptr; 2: the byte at scales_ptr where scale_known_ptr's byte is non-zero,
    the block's own (RNE) scale elsewhere; either way the bytes used go to scales_out_ptr.
    BITS_KNOWN: known_ptr (int16, one word per block, as bits_ptr) marks the elements whose
    mantissa bit is given; the others round to nearest (the guided code with the RNE code's
    bit is the RNE code).
    """
    pid = tl.program_id(0).to(tl.int64)
    if ROW_PROGRAM:
        b_idx = pid * BPR + tl.arange(0, BLOCK_B)
        b_mask = tl.arange(0, BLOCK_B) < BPR
    else:
        b_idx = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        b_mask = b_idx < NB
    jw = tl.arange(0, 4)
    offs = b_idx[:, None] * 8 + jw[None, :]
    mask = b_mask[:, None]
    x0 = tl.load(x_ptr + offs, mask=mask, other=0)
    x1 = tl.load(x_ptr + offs + 4, mask=mask, other=0)
    # Every load first: a load after a store or a barrier waits for it.
    if GUIDED:
        sb = tl.load(scales_ptr + b_idx, mask=b_mask, other=0x38).to(tl.int32)
        word = tl.load(bits_ptr + b_idx, mask=b_mask, other=0).to(tl.int32)  # a block's 16 bits (int16)
        if SCALE_RULE == 2:
            scale_known = tl.load(scale_known_ptr + b_idx, mask=b_mask, other=1).to(tl.int32)
        if BITS_KNOWN:
            known_word = tl.load(known_ptr + b_idx, mask=b_mask, other=0).to(tl.int32)
    if G_MODE == 1:
        g = tl.load(g_ptr)
    elif G_MODE == 2:
        if ROW_PROGRAM:
            g = tl.load(g_ptr + pid)
        else:
            g = tl.load(g_ptr + b_idx // BPR, mask=b_mask, other=1.0)
    # Block amax as BF16 bits: magnitudes compare as integers, and NaN's bits exceed Inf's.
    if INTERPRET:
        m = tl.reduce(_max_lanes(x0 & 0x7FFF7FFF, x1 & 0x7FFF7FFF), 1, _max_lanes)
    else:
        m = tl.reduce(_max_u16x2(x0 & 0x7FFF7FFF, x1 & 0x7FFF7FFF), 1, _max_u16x2)
    amax_bits = tl.maximum(m & 0xFFFF, m >> 16)
    block_amax = (amax_bits << 16).to(tl.float32, bitcast=True)
    if G_MODE == 3:  # the row's amax also answers the non-finite test: no second reduction
        row_bits = tl.max(amax_bits, axis=0)
        g = _row_global_scale((row_bits << 16).to(tl.float32, bitcast=True))
        tl.store(g_ptr + pid, g)
        tl.store(bad_ptr + pid, (row_bits >= 0x7F80).to(tl.uint8))
    if GUIDED:
        if SCALE_RULE == 1:
            sb = _nvfp4_block_scale_bytes_guided(block_amax, g, sb & 1)
        elif SCALE_RULE == 2:
            _own_s, own_byte = _nvfp4_block_scales(block_amax, g)
            sb = tl.where(scale_known != 0, sb, own_byte)
        if SCALE_RULE != 0:
            tl.store(scales_out_ptr + b_idx, sb.to(tl.uint8), mask=b_mask)
        s = _e4m3_value(sb)
    else:
        s, scale_byte = _nvfp4_block_scales(block_amax, g)
        tl.store(scales_ptr + b_idx, scale_byte.to(tl.uint8), mask=b_mask)
    u = s * g
    if FAKE:
        # The values and the bound from the scale byte as stored, as dequantize and ste_mask read
        # it (the same value as s, except for blocks holding NaN under the interpreter).
        if GUIDED:
            s_q = s
        else:
            s_q = _e4m3_value(scale_byte.to(tl.uint8).to(tl.int32))
        if G_MODE == 2 and not ROW_PROGRAM:
            g_q = g[:, None]
        else:
            g_q = g
        bound = (7.0 * (s_q * g))[:, None]  # block_clip_bound: fl32(7 * fl32(s * g))

    if GUIDED:
        a1, a2, a3, b1, b2, b3 = _guided_thresholds(u, INTERPRET)
        if BITS_KNOWN:
            t1, t2, t3, t4, t5, t6, t7 = _rne_thresholds(u, INTERPRET)
    else:
        t1, t2, t3, t4, t5, t6, t7 = _rne_thresholds(u, INTERPRET)
    for h in tl.static_range(2):
        if h == 0:
            xh = x0
        else:
            xh = x1
        if GUIDED:
            pair_bits = (word[:, None] >> (8 * h + 2 * jw)[None, :]) & 3
            if BITS_KNOWN:  # elsewhere the RNE code's bits: its low nibble's bit 0, its high nibble's
                known = (known_word[:, None] >> (8 * h + 2 * jw)[None, :]) & 3
                rne = _rne_pair_codes(xh, t1[:, None], t2[:, None], t3[:, None], t4[:, None], t5[:, None],
                                      t6[:, None], t7[:, None], INTERPRET).to(tl.int32)
                own = (rne & 1) | ((rne >> 3) & 2)
                pair_bits = (pair_bits & known) | (own & (known ^ 3))
            codes = _guided_pair_codes(xh, a1[:, None], a2[:, None], a3[:, None], b1[:, None], b2[:, None],
                                       b3[:, None], pair_bits, INTERPRET)
        else:
            codes = _rne_pair_codes(xh, t1[:, None], t2[:, None], t3[:, None], t4[:, None], t5[:, None],
                                    t6[:, None], t7[:, None], INTERPRET)
        if FAKE:
            tl.store(codes_ptr + offs + 4 * h, _dequant_pair(codes, s_q[:, None], g_q, INTERPRET), mask=mask)
            if MASK_OUT or CLIP_OUT:
                inside = _inside_pair(xh, bound)
            if MASK_OUT:
                tl.store(mask_ptr + offs + 4 * h, inside, mask=mask)
            if CLIP_OUT:
                outside = tl.max(tl.where(mask, inside != 0x0101, 0).to(tl.int32))  # 0x0101: both bytes true
                if h == 0:
                    clipped = outside
                else:
                    clipped = tl.maximum(clipped, outside)
        else:
            tl.store(codes_ptr + offs + 4 * h, codes, mask=mask)
    if FAKE and CLIP_OUT:
        tl.store(clip_ptr + pid, clipped.to(tl.uint8))
    if G_MODE != 3:
        bad = tl.max((amax_bits >= 0x7F80).to(tl.int32), axis=0)
        tl.store(bad_ptr + pid, bad.to(tl.uint8))


# Launch shape of the BF16 kernel: blocks per program for flat tiles, and blocks per thread.
BF16_TILE_BLOCKS = 256
BF16_BLOCKS_PER_THREAD = 2
BF16_GUIDED_BLOCKS_PER_THREAD = 1
BF16_MAX_WARPS = 16


def _bf16_fast_path(x_MK: torch.Tensor) -> bool:
    return (x_MK.dtype == torch.bfloat16 and x_MK.is_contiguous() and x_MK.data_ptr() % 16 == 0
            and x_MK.shape[-1] % 16 == 0)


def _bf16_launch(row_program: bool, m: int, nb: int, bpr: int, guided: bool = False) -> tuple[int, int, int]:
    """(BLOCK_B, programs, num_warps) of `_quantize_bf16_kernel`."""
    if row_program:
        block_b, grid = triton.next_power_of_2(bpr), m
    else:
        block_b = max(1, min(BF16_TILE_BLOCKS, triton.next_power_of_2(nb)))
        grid = triton.cdiv(nb, block_b)
    per_thread = BF16_GUIDED_BLOCKS_PER_THREAD if guided else BF16_BLOCKS_PER_THREAD
    warps = max(1, min(BF16_MAX_WARPS, block_b // (32 * per_thread)))
    return block_b, grid, warps


def _quantize_bf16(x_MK, codes, scales, g, g_mode, bits=None, mask=None, partial=None, answer=False):
    """Launch `_quantize_bf16_kernel` over contiguous BF16 rows; returns (the non-finite flags,
    with `answer` (FAKE only) a 0-d bool whether the mask is all true, else None).
    codes: packed codes uint8 [M, K/2], or bf16 [M, K] for the dequantized values (FAKE); mask:
    bool [M, K] for the straight-through mask (FAKE only), or None. partial (with bits): the
    tuple (SCALE_RULE, scale_known uint8 [M, K/16] or None, bit_known uint8 [M, K/8] or None,
    scales_out uint8 [M, K/16]) of `fake_quantize_partly_guided_bf16_triton`."""
    m, k = x_MK.shape
    nb, bpr = m * k // 16, k // 16
    fake = codes.dtype == torch.bfloat16
    row_program = g_mode == G_ROW_AMAX or (g_mode == G_ROW and k <= MAX_ROW_ELEMENTS)
    block_b, grid, warps = _bf16_launch(row_program, m, nb, bpr, bits is not None)
    bad = torch.empty((grid,), dtype=torch.uint8, device=x_MK.device)
    clipped = torch.empty((grid,), dtype=torch.uint8, device=x_MK.device) if answer else None
    scale_rule, scale_known, bit_known, scales_out = partial or (0, None, None, None)
    if grid:
        out = codes.view(torch.int32) if fake else codes
        _quantize_bf16_kernel[(grid,)](
            x_MK.view(torch.int32), out, scales, g, bad, out if bits is None else bits.view(torch.int16), nb, bpr,
            G_MODE=g_mode, GUIDED=bits is not None, ROW_PROGRAM=row_program, BLOCK_B=block_b,
            INTERPRET=_interpreting(), FAKE=fake, MASK_OUT=mask is not None,
            mask_ptr=None if mask is None else mask.view(torch.int16), SCALE_RULE=scale_rule,
            BITS_KNOWN=bit_known is not None, scale_known_ptr=scale_known,
            known_ptr=None if bit_known is None else bit_known.view(torch.int16), scales_out_ptr=scales_out,
            CLIP_OUT=answer, clip_ptr=clipped, num_warps=warps, enable_fp_fusion=False,
        )
    return bad, None if clipped is None else ~clipped.view(torch.bool).any()  # flags of 0 or 1


def fusable(x_MK: torch.Tensor, bits: torch.Tensor | None = None) -> bool:
    """Whether `fake_quantize_bf16_triton` takes these rows (and guidance mantissa bits)."""
    return _bf16_fast_path(x_MK) and (bits is None or (bits.is_contiguous() and bits.data_ptr() % 2 == 0))


def fake_quantize_bf16_triton(
    x_MK: torch.Tensor,
    row_scale: bool = True,
    global_amax: torch.Tensor | None = None,
    row_amax: torch.Tensor | None = None,
    guidance: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    with_mask: bool = True,
    with_answer: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """NVFP4 fake quantization (RNE or guided) of BF16 rows and its straight-through mask, in one
    pass: x read once, values and mask written once (`_quantize_bf16_kernel`, FAKE).

    Args:
        x_MK: bfloat16 [M, K], `fusable`.
        row_scale, global_amax, row_amax: as `quantize_rows_triton` (without row_amax, rows of at
            most MAX_ROW_ELEMENTS get their amax in the kernel).
        guidance: (g float32 [M], scale bytes uint8 [M, K/16], mantissa bits uint8 [M, K/8]), as
            `quantize_guided_rows_triton`; then row_scale, global_amax and row_amax are unused.
        with_mask: also write the mask.
        with_answer: also answer whether the mask is all true (written or not), from the kernel's
            per-program flags rather than a pass over the mask.
    Returns:
        (dequantized values bf16 [M, K], mask bool [M, K] or None, block scale bytes uint8 [M, K/16],
         global scale float32 ([M] for rows, 0-d for tensor), non-finite flag uint8 per program,
         the answer: 0-d bool, or None without with_answer).
    """
    if not fusable(x_MK, None if guidance is None else guidance[2]):
        raise ValueError("fake_quantize_bf16_triton: rows must be contiguous 16-byte aligned bfloat16, K % 16 == 0, "
                         "and mantissa bits contiguous and 2-byte aligned")
    m, k = x_MK.shape
    dev = x_MK.device
    out = torch.empty((m, k), dtype=torch.bfloat16, device=dev)
    mask = torch.empty((m, k), dtype=torch.bool, device=dev) if with_mask else None
    if guidance is not None:
        g, scales, bits = guidance
        bad, all_inside = _quantize_bf16(x_MK, out, scales, g, G_ROW, bits=bits, mask=mask, answer=with_answer)
        return out, mask, scales, g, bad, all_inside
    scales = torch.empty((m, k // 16), dtype=torch.uint8, device=dev)
    g, g_mode = _nvfp4_g(x_MK, row_scale, global_amax, row_amax)
    return out, mask, scales, g, *_quantize_bf16(x_MK, out, scales, g, g_mode, mask=mask, answer=with_answer)


SCALES_GIVEN, SCALES_BY_LSB, SCALES_WHERE_KNOWN = 0, 1, 2  # SCALE_RULE of `_quantize_bf16_kernel`


def fake_quantize_partly_guided_bf16_triton(
    x_MK: torch.Tensor, g: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, scale_rule: int,
    scale_known: torch.Tensor | None, bit_known: torch.Tensor | None, with_mask: bool = True,
    with_answer: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`fake_quantize_bf16_triton` under partial guidance (sparse records), in the same one pass:
    the block scales and mantissa bits the guidance leaves open are the rows' own (see
    `_quantize_bf16_kernel`'s SCALE_RULE and BITS_KNOWN).

    Args:
        x_MK: bfloat16 [M, K], `fusable` with bits and bit_known.
        g: float32 [M]; scales: uint8 [M, K/16] (their last bits only, under SCALES_BY_LSB);
        bits, bit_known: uint8 [M, K/8] (bit_known None: every bit given); scale_known: uint8
        [M, K/16] (SCALES_WHERE_KNOWN only).
    Returns:
        (values bf16 [M, K], mask bool [M, K] or None, the block scale bytes used uint8 [M, K/16],
         g, non-finite flag uint8 per program, the answer or None, as `fake_quantize_bf16_triton`).
    """
    if not (fusable(x_MK, bits) and (bit_known is None or fusable(x_MK, bit_known))):
        raise ValueError("fake_quantize_partly_guided_bf16_triton: rows must be contiguous 16-byte aligned bfloat16, "
                         "K % 16 == 0, and the mantissa bits and known bits contiguous and 2-byte aligned")
    if (scale_rule == SCALES_WHERE_KNOWN) != (scale_known is not None):
        raise ValueError("fake_quantize_partly_guided_bf16_triton: scale_known goes with SCALES_WHERE_KNOWN only")
    m, k = x_MK.shape
    dev = x_MK.device
    out = torch.empty((m, k), dtype=torch.bfloat16, device=dev)
    mask = torch.empty((m, k), dtype=torch.bool, device=dev) if with_mask else None
    scales_out = scales if scale_rule == SCALES_GIVEN else torch.empty_like(scales)
    partial = (scale_rule, scale_known, bit_known, scales_out)
    bad, all_inside = _quantize_bf16(x_MK, out, scales, g, G_ROW, bits=bits, mask=mask, partial=partial,
                                     answer=with_answer)
    return out, mask, scales_out, g, bad, all_inside


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _flat_grid(nb: int, bs: int) -> tuple[int, int]:
    block_b = max(1, min(TILE_ELEMENTS // bs, triton.next_power_of_2(nb)))
    return block_b, triton.cdiv(nb, block_b)


def _row_scales(x_MK: torch.Tensor, row_amax: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Per-row global scales of row-scaled NVFP4 and how the kernel finds them: from `row_amax`
    (float32 [M]) when given; else computed in the kernel (G_ROW_AMAX, its output buffer) for
    rows it holds whole; else, for long rows, from an exact torch amax first (G_ROW)."""
    m, k = x_MK.shape
    if row_amax is not None:
        return nvfp4_global_scale(row_amax.to(x_MK.device, torch.float32)), G_ROW
    if k <= MAX_ROW_ELEMENTS:
        return torch.empty((m,), dtype=torch.float32, device=x_MK.device), G_ROW_AMAX
    row_amax = torch.linalg.vector_norm(x_MK, float("inf"), dim=-1, dtype=torch.float32)
    return nvfp4_global_scale(row_amax), G_ROW


def _nvfp4_g(x_MK: torch.Tensor, row_scale: bool, global_amax: torch.Tensor | None,
             row_amax: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """NVFP4's global scale(s) and G_MODE: from global_amax (0-d) for tensor scaling, else as
    `_row_scales`."""
    if not row_scale:
        return nvfp4_global_scale(global_amax.to(x_MK.device)), G_TENSOR
    return _row_scales(x_MK, row_amax)


def _launch_grid(g_mode: int, m: int, nb: int, bs: int) -> tuple[int, int]:
    """(BLOCK_B, programs) of the quantize kernel: one program per row in G_ROW_AMAX mode, else
    flat tiles of blocks."""
    if g_mode == G_ROW_AMAX:
        return triton.next_power_of_2(nb // max(m, 1)), m
    return _flat_grid(nb, bs)


def quantize_rows_triton(
    x_MK: torch.Tensor,
    fmt: Format,
    row_scale: bool,
    stochastic: bool,
    key: int,
    global_amax: torch.Tensor | None,
    mx_rule: MXScaleRule,
    row_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Quantize contiguous 2-D rows with the Triton kernel.

    Args:
        x_MK: float32/bfloat16/float16 [M, K], contiguous.
        global_amax: tensor-scaled NVFP4 only: the amax the global scale is computed from.
        row_amax: row-scaled NVFP4 only, optional: float32 [M], each row's amax (for rows
            sharded across ranks, the all-reduced amax of the whole row).
    Returns:
        (packed codes uint8 [M, K/2], block scale bytes uint8 [M, K/bs],
         global scale float32 ([M] for rows, 0-d for tensor, None for MXFP4),
         non-finite flag uint8 per program).
    """
    m, k = x_MK.shape
    bs = fmt.block_size
    nb, bpr = m * k // bs, k // bs
    dev = x_MK.device
    codes = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((m, bpr), dtype=torch.uint8, device=dev)
    if fmt is Format.MXFP4:
        g, g_mode = None, G_NONE
    else:
        g, g_mode = _nvfp4_g(x_MK, row_scale, global_amax, row_amax)
    if fmt is Format.NVFP4 and not stochastic and _bf16_fast_path(x_MK):
        return codes, scales, g, _quantize_bf16(x_MK, codes, scales, g, g_mode)[0]
    block_b, grid = _launch_grid(g_mode, m, nb, bs)
    num_warps = 8 if block_b * bs >= 4096 else 4
    bad = torch.empty((grid,), dtype=torch.uint8, device=dev)
    _quantize_kernel[(grid,)](
        x_MK, codes, scales, codes if g is None else g, bad, codes, nb, bpr, key, codes, 0, 0,
        IS_MX=g_mode == G_NONE, G_MODE=g_mode, STOCHASTIC=stochastic,
        CEIL_RULE=mx_rule is MXScaleRule.CEIL, GUIDED=False, BS=bs, BLOCK_B=block_b,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return codes, scales, g, bad


def quantize_rows_into_triton(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                              g: torch.Tensor) -> None:
    """Row-scaled NVFP4 of rows (token, head) of x [n, H, K] (any strides with the last 1),
    written at slots: codes[slots[t], h] (uint8 [S, H, K/2]), scales[slots[t], h] (uint8 [S, H,
    K/16]), g[slots[t], h] (float32 [S, H, 1]). One kernel, the same values as
    `quantize_rows_triton` on the rows (what a paged KV cache stores for new tokens)."""
    n, heads, k = x.shape
    if x.stride(2) != 1 or k % 16 or k > MAX_ROW_ELEMENTS:
        raise ValueError(f"quantize_rows_into: rows must be contiguous, of at most {MAX_ROW_ELEMENTS} elements and a "
                         f"multiple of 16, got shape {tuple(x.shape)} strides {x.stride()}")
    for name, t, last in (("codes", codes, k // 2), ("scales", scales, k // 16), ("g", g, 1)):
        if t.dim() != 3 or t.shape[1:] != (heads, last) or not t.is_contiguous():
            raise ValueError(f"quantize_rows_into: {name} must be contiguous [S, {heads}, {last}], "
                             f"got {tuple(t.shape)}")
    if n == 0:
        return
    bpr = k // 16
    block_b = triton.next_power_of_2(bpr)
    bad = torch.empty((n * heads,), dtype=torch.uint8, device=x.device)
    _quantize_kernel[(n * heads,)](
        x, codes, scales, g, bad, codes, n * heads * bpr, bpr, 0, slots, x.stride(0), x.stride(1),
        IS_MX=False, G_MODE=G_ROW_AMAX, STOCHASTIC=False, CEIL_RULE=False, GUIDED=False, BS=16, BLOCK_B=block_b,
        HEADS=heads, num_warps=4, enable_fp_fusion=False,
    )


def fake_quantize_rows_triton(
    x_MK: torch.Tensor, capture: bool, pre: int = PRE_NONE, weight: torch.Tensor | None = None, eps: float = 0.0,
    residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row-scaled NVFP4 fake quantization of contiguous rows in one kernel, optionally of rows
    the same kernel computes first (`pre`, see `_quantize_kernel`).

    Args:
        x_MK: float32/bfloat16/float16 [M, K], contiguous, K a multiple of 16; PRE_RMS_NORM:
            bfloat16 [M, K] with `weight` float32 [K] and `eps`, or float32 [S, M, K], a split-K
            GEMM's partial products (summed first, `linear.sum_parts`); PRE_SILU_MUL: bfloat16
            [M, 2K], gate then up.
        residual, sum_out: PRE_RMS_NORM only: bf16 [M, K] added to x before the norm; bf16
            [M, K] that receives x (required with partial products or a residual).
        capture: also write each element's mantissa bit.
    Returns:
        (dequantized values [M, K] in x's dtype (bf16 from partial products), mantissa bits uint8 [M, K/8] or None,
         block scale bytes uint8 [M, K/16], global scales float32 [M], non-finite flag per
         program, the rows quantized bf16 [M, K] when `pre` else None).
    """
    parts = x_MK.shape[0] if x_MK.dim() == 3 else 0
    m, k = x_MK.shape[-2:]
    summed = parts or residual is not None
    if summed and (pre != PRE_RMS_NORM or sum_out is None or sum_out.shape != (m, k)):
        raise ValueError("fake_quantize_rows_triton: partial products or a residual go with PRE_RMS_NORM and a "
                         f"sum_out of [{m}, {k}]")
    if pre == PRE_SILU_MUL:
        k //= 2
    nb, bpr = m * k // 16, k // 16
    dev = x_MK.device
    out = torch.empty((m, k), dtype=torch.bfloat16 if parts else x_MK.dtype, device=dev)
    pre_out = torch.empty((m, k), dtype=torch.bfloat16, device=dev) if pre else None
    scales = torch.empty((m, bpr), dtype=torch.uint8, device=dev)
    bits = torch.empty((m, k // 8), dtype=torch.uint8, device=dev) if capture else scales
    g, g_mode = _row_scales(out, None) if pre else _row_scales(x_MK, None)
    if pre and g_mode != G_ROW_AMAX:
        raise ValueError(f"a fused fake quantize needs rows of at most {MAX_ROW_ELEMENTS} elements, got {k}")
    block_b, grid = _launch_grid(g_mode, m, nb, 16)
    bad = torch.empty((grid,), dtype=torch.uint8, device=dev)
    if grid:
        _quantize_kernel[(grid,)](
            x_MK, out, scales, g, bad, bits, nb, bpr, 0, out, x_MK.stride(0), 0,
            IS_MX=False, G_MODE=g_mode, STOCHASTIC=False, CEIL_RULE=False, GUIDED=False, BS=16, BLOCK_B=block_b,
            FAKE=True, BITS_OUT=capture, INTERPRET=_interpreting(), PRE=pre,
            pre_w_ptr=out if weight is None else weight, pre_out_ptr=out if pre_out is None else pre_out, eps=eps,
            PARTS=parts, RESIDUAL=residual is not None, res_ptr=out if residual is None else residual,
            sum_out_ptr=sum_out if summed else out,
            num_warps=_fake_row_warps(m, k), enable_fp_fusion=False,
        )
    return out, bits if capture else None, scales, g, bad, pre_out


def quantize_guided_rows_triton(
    x_MK: torch.Tensor, g_M: torch.Tensor, scale_bytes_MB: torch.Tensor, bits_packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Guided NVFP4 codes of contiguous rows; as reference.nvfp4_quantize_guided_reference.

    Args:
        x_MK: float32/bfloat16/float16 [M, K]; g_M: float32 [M]; scale_bytes_MB: uint8 [M, K/16];
        bits_packed: uint8 [M, K/8], element i of a row in bit i % 8 of byte i // 8.
    Returns:
        (packed codes uint8 [M, K/2], non-finite flag uint8 per program).
    """
    m, k = x_MK.shape
    nb = m * k // 16
    codes = torch.empty((m, k // 2), dtype=torch.uint8, device=x_MK.device)
    if _bf16_fast_path(x_MK) and bits_packed.is_contiguous() and bits_packed.data_ptr() % 2 == 0:
        return codes, _quantize_bf16(x_MK, codes, scale_bytes_MB, g_M, G_ROW, bits=bits_packed)[0]
    block_b, grid = _flat_grid(nb, 16)
    bad = torch.empty((grid,), dtype=torch.uint8, device=x_MK.device)
    _quantize_kernel[(grid,)](
        x_MK, codes, scale_bytes_MB, g_M, bad, bits_packed, nb, k // 16, 0, codes, 0, 0,
        IS_MX=False, G_MODE=G_ROW, STOCHASTIC=False, CEIL_RULE=False, GUIDED=True,
        BS=16, BLOCK_B=block_b, num_warps=8 if block_b * 16 >= 4096 else 4, enable_fp_fusion=False,
    )
    return codes, bad


def dequantize_rows_triton(
    codes: torch.Tensor, scale_bytes: torch.Tensor, g: torch.Tensor | None, fmt: Format, dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize packed rows: codes uint8 [M, K/2], scale bytes uint8 [M, K/bs], g 0-d or [M].

    Returns `dtype` [M, K], equal to the reference's float32 values cast to `dtype`.
    """
    m, k = codes.shape[0], codes.shape[1] * 2
    bs = fmt.block_size
    nb = m * k // bs
    out = torch.empty((m, k), dtype=dtype, device=codes.device)
    block_b, grid = _flat_grid(nb, bs)
    g_mode = G_NONE if g is None else (G_ROW if g.dim() else G_TENSOR)
    _dequantize_kernel[(grid,)](
        codes, scale_bytes, codes if g is None else g, out, nb, k // bs,
        IS_MX=g_mode == G_NONE, G_MODE=g_mode, BS=bs, BLOCK_B=block_b, INTERPRET=_interpreting(),
        num_warps=8 if block_b * bs >= 4096 else 4, enable_fp_fusion=False,
    )
    return out
