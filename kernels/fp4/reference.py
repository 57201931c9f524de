"""Torch reference of the FP4 numerics (docs/design.md section 2); runs on any device.

This is the specification in code: the Triton kernels in `triton_fp4.py` must equal it bit
for bit. Every step is one IEEE-exact FP32 operation in a fixed order (no reciprocals, no
fused multiply-adds), so the result does not depend on the device.

Shape suffixes: a name ends in the letters of its dimensions (sglang_rollout/engine/model.py
uses the same convention for the model's tensors).
    M  rows          K  elements per row (the reduction dimension, in blocks)
    B  blocks per row (K / 16 for NVFP4, K / 32 for MXFP4)      1  a kept dimension of size one
x_MK rows of the input, g_M1 per-row (or 0-d per-tensor) global scales, s_MB block scales,
codes_MK unpacked codes.
"""

from __future__ import annotations

import torch

from . import rng
from .formats import (
    E2M1_MAX,
    E2M1_SIGN_BIT,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    NVFP4_GLOBAL_DENOM,
    MXScaleRule,
    div_exact,
    e2m1_magnitude_code_floor,
    e2m1_magnitude_code_rne,
    e2m1_magnitude_of_code,
    e2m1_step_above,
    e2m1_to_float,
    e4m3_to_float,
    e8m0_to_float,
)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Global scale in the decode direction, g = amax / (6 * 448), float32, same shape.

    A zero amax (an all-zero row or tensor) gives g = 1.0; so does an amax so small
    (< ~3.8e-42) that g underflows to zero, whose elements then all round to zero.
    """
    g = div_exact(amax.to(torch.float32), NVFP4_GLOBAL_DENOM)
    return torch.where(g == 0, torch.ones_like(g), g)


def nvfp4_block_scale_unrounded(block_amax: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """block_amax / (6 g) in float32, before clamping and E4M3 rounding. [M, B]."""
    return block_amax / (6.0 * g)


def nvfp4_block_amax(x_MK: torch.Tensor) -> torch.Tensor:
    """Per-block amax of NVFP4 rows: float32 [M, K/16]."""
    m, k = x_MK.shape
    return x_MK.to(torch.float32).reshape(m, k // 16, 16).abs().amax(-1)


def nvfp4_scaled_values(x_MK: torch.Tensor, g: torch.Tensor, s_MB: torch.Tensor) -> torch.Tensor:
    """x / (float(s) * g) in float32, the value each element's code rounds: [M, K]."""
    m, k = x_MK.shape
    u_MB = e4m3_to_float(s_MB) * g
    return (x_MK.to(torch.float32).reshape(m, k // 16, 16) / u_MB.unsqueeze(-1)).reshape(m, k)


def nvfp4_block_scales(block_amax: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales s = e4m3(clamp(block_amax / (6 g), 2**-9, 448)); all-zero blocks get 1.0.

    Args:
        block_amax: float32 [M, B].
        g: float32 [M, 1] or 0-d.
    Returns:
        float8_e4m3fn [M, B].
    """
    r = nvfp4_block_scale_unrounded(block_amax, g)
    s = r.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(block_amax == 0, torch.ones_like(s), s)


def nvfp4_block_scales_guided(block_amax: torch.Tensor, g: torch.Tensor, lsb: torch.Tensor) -> torch.Tensor:
    """Block scales chosen like guided elements: the E4M3 value nearest to block_amax / (6 g)
    (clamped to [2**-9, 448]) whose code's last bit is `lsb`.

    Consecutive positive E4M3 codes alternate their last bit, so whenever the engine's scale
    is a neighbour of the trainer's pre-rounding value this returns it. All-zero blocks get 1.0.

    Args:
        block_amax: float32 [M, B]; g: float32 [M, 1] or 0-d; lsb: 0/1 integers [M, B].
    Returns:
        float8_e4m3fn [M, B].
    """
    r = nvfp4_block_scale_unrounded(block_amax, g).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    near = r.to(torch.float8_e4m3fn)
    b = near.view(torch.uint8).to(torch.int32)
    lo = torch.where(near.float() > r, b - 1, b)
    lo_val = lo.to(torch.uint8).view(torch.float8_e4m3fn).float()
    up = ((r > lo_val) & (lo < 0x7E)) | (lo == 1)  # code 1 (2**-9) is the floor of the clamp
    code = torch.where((lo & 1) == lsb.to(torch.int32), lo, torch.where(up, lo + 1, lo - 1))
    s = code.to(torch.uint8).view(torch.float8_e4m3fn)
    return torch.where(block_amax == 0, torch.ones_like(s), s)


def mxfp4_block_exponents(block_amax: torch.Tensor, rule: MXScaleRule) -> torch.Tensor:
    """Unbiased power-of-two exponent of each MXFP4 block scale, int32, same shape.

    FLOOR: floor(log2(amax)) - 2. CEIL: ceil(log2(amax / 6)). Both read the exponent from
    the FP32 bits (exact, no log2), clamp to E8M0's [-127, 127], and give 0 (scale 1) for
    an all-zero block.
    """
    if rule is MXScaleRule.FLOOR:
        a = block_amax
    else:
        a = div_exact(block_amax, E2M1_MAX)
    bits = a.view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if rule is MXScaleRule.FLOOR:
        # A subnormal amax has floor(log2) <= -127, which clamps to -127 below anyway.
        e = torch.where(exp_field == 0, E8M0_MIN_EXP + 2, exp_field - 127) - 2
    else:
        e_normal = exp_field - 127 + (mantissa != 0).int()
        # Subnormal a: ceil(log2 a) is -126 above 2**-127 (bits 0x400000), else <= -127.
        e_sub = torch.where(bits > 0x400000, -126, E8M0_MIN_EXP)
        e = torch.where(exp_field == 0, e_sub, e_normal)
    e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.where(block_amax == 0, torch.zeros_like(e), e).to(torch.int32)


def round_scaled_to_e2m1(
    v: torch.Tensor, stochastic: bool = False, index: torch.Tensor | None = None, key: int = 0
) -> torch.Tensor:
    """Round scaled float32 values to unpacked E2M1 codes, saturating at +-6.

    RNE by default. Stochastic: with lo <= |v| < hi the neighbouring magnitudes, round up
    when u < (|v| - lo) / (hi - lo), u the counter-based uniform of the element's flat
    index; every step is exact (the grid steps are powers of two), so E[value] = v.

    Args:
        v: float32 [...].
        index: int64 flat element indices, same shape as v (stochastic only).
    Returns:
        uint8 codes 0..15, same shape. Negative values keep the sign bit at magnitude 0.
    """
    a = v.abs().clamp(max=E2M1_MAX)
    if stochastic:
        lo = e2m1_magnitude_code_floor(a)
        frac = (a - e2m1_magnitude_of_code(lo)) / e2m1_step_above(lo)
        u = rng.uniform_from_counter(index, key)
        mag = lo + (u < frac).int()
    else:
        mag = e2m1_magnitude_code_rne(a)
    return mag.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) * E2M1_SIGN_BIT)


def round_guided_to_e2m1(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Guided rounding (docs/design.md 4.3): the E2M1 code nearest to v whose mantissa bit is `bits`.

    With lo the largest magnitude code not above |v|: if lo's mantissa bit (lo & 1) matches,
    lo; otherwise its upper neighbour when |v| lies strictly above lo's magnitude (or lo is
    0), else its lower neighbour (|v| exactly on the grid, where the lower step is never
    larger than the upper one, or |v| saturated at 6). Consecutive magnitudes alternate their
    mantissa bit, so whenever the engine's code is one of v's two neighbours this returns it
    exactly. The sign comes from v.

    Args:
        v: float32 scaled values [...].
        bits: uint8/bool mantissa bits (0/1), same shape.
    Returns:
        uint8 codes 0..15, same shape.
    """
    a = v.abs().clamp(max=E2M1_MAX)
    lo = e2m1_magnitude_code_floor(a)
    up = ((a > e2m1_magnitude_of_code(lo)) & (lo < 7)) | (lo == 0)
    mag = torch.where((lo & 1) == bits.to(torch.int32), lo, torch.where(up, lo + 1, lo - 1))
    return mag.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) * E2M1_SIGN_BIT)


def nvfp4_quantize_guided_reference(
    x_MK: torch.Tensor, g_M1: torch.Tensor, s_MB: torch.Tensor, bits_MK: torch.Tensor
) -> torch.Tensor:
    """NVFP4 codes of rows under given scales and mantissa bits (guided rounding).

    Args:
        x_MK: float32/bfloat16/float16 [M, K], the trainer's values.
        g_M1: float32 [M, 1] row global scales, taken as given (the engine's).
        s_MB: float8_e4m3fn [M, K/16] block scales, taken as given.
        bits_MK: uint8 [M, K] unpacked mantissa bits (0/1).
    Returns:
        codes_MK uint8 [M, K] unpacked.
    """
    return round_guided_to_e2m1(nvfp4_scaled_values(x_MK, g_M1, s_MB), bits_MK)


def _element_index(m: int, k: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(m, device=device, dtype=torch.int64).unsqueeze(1) * k
    return rows + torch.arange(k, device=device, dtype=torch.int64)


def nvfp4_quantize_reference(
    x_MK: torch.Tensor, g: torch.Tensor, stochastic: bool = False, key: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 codes and block scales of 2-D rows given their global scale(s).

    Args:
        x_MK: float32/bfloat16/float16 [M, K], K a multiple of 16, finite.
        g: float32 global scale, 0-d or [M, 1] (from `nvfp4_global_scale`).
    Returns:
        (codes_MK uint8 [M, K] unpacked, s_MB float8_e4m3fn [M, K/16]).
    """
    m, k = x_MK.shape
    s_MB = nvfp4_block_scales(nvfp4_block_amax(x_MK), g)
    v = nvfp4_scaled_values(x_MK, g, s_MB)
    index = _element_index(m, k, x_MK.device) if stochastic else None
    return round_scaled_to_e2m1(v, stochastic, index, key), s_MB


def mxfp4_quantize_reference(
    x_MK: torch.Tensor, rule: MXScaleRule = MXScaleRule.FLOOR, stochastic: bool = False, key: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes and E8M0 block scales of 2-D rows.

    Args:
        x_MK: float32/bfloat16/float16 [M, K], K a multiple of 32, finite.
    Returns:
        (codes_MK uint8 [M, K] unpacked, scale bytes uint8 [M, K/32]).
    """
    m, k = x_MK.shape
    x_MBb = x_MK.to(torch.float32).reshape(m, k // 32, 32)
    e_MB = mxfp4_block_exponents(x_MBb.abs().amax(-1), rule)
    scale_bytes = (e_MB + E8M0_BIAS).to(torch.uint8)
    v = x_MBb / e8m0_to_float(scale_bytes).unsqueeze(-1)
    index = _element_index(m, k, x_MK.device).reshape(m, k // 32, 32) if stochastic else None
    codes = round_scaled_to_e2m1(v, stochastic, index, key)
    return codes.reshape(m, k), scale_bytes


def nvfp4_dequantize_reference(codes_MK: torch.Tensor, s_MB: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """value = (e2m1(code) * float(s)) * g, float32 [M, K]. Multiplication order is fixed."""
    m, k = codes_MK.shape
    vals = e2m1_to_float(codes_MK).reshape(m, k // 16, 16)
    scaled = vals * e4m3_to_float(s_MB).unsqueeze(-1)
    g_b = g.unsqueeze(-1) if g.dim() else g
    return (scaled * g_b).reshape(m, k)


def mxfp4_dequantize_reference(codes_MK: torch.Tensor, scale_bytes_MB: torch.Tensor) -> torch.Tensor:
    """value = e2m1(code) * 2**(byte - 127), float32 [M, K] (exact)."""
    m, k = codes_MK.shape
    vals = e2m1_to_float(codes_MK).reshape(m, k // 32, 32)
    return (vals * e8m0_to_float(scale_bytes_MB).unsqueeze(-1)).reshape(m, k)
