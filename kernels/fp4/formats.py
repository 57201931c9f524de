"""FP4 formats and their element and scale codecs (docs/design.md section 2).

Shape legend used across `trace_kernels.fp4`:
    M  rows (all leading dimensions of a tensor flattened)
    K  the last (reduction) dimension; blocks run along it
    B  blocks per row, K / block_size
Codes are unpacked uint8 values 0..15 unless a name says `packed` (two per byte).
"""

from __future__ import annotations

import enum

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
# g = amax / (6 * 448): one FP32 division by the exact constant 2688.
NVFP4_GLOBAL_DENOM = E2M1_MAX * E4M3_MAX

# Magnitudes of E2M1 codes 0..7; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN_BIT = 8
# Midpoints between neighbouring magnitudes: where round-to-nearest changes code.
E2M1_ROUNDING_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class Format(str, enum.Enum):
    """An FP4 block format: element E2M1, block size and scale type."""

    NVFP4 = "nvfp4"  # blocks of 16, E4M3 block scale, FP32 global scale
    MXFP4 = "mxfp4"  # blocks of 32, E8M0 power-of-two block scale, no global scale

    @property
    def block_size(self) -> int:
        return 16 if self is Format.NVFP4 else 32


class MXScaleRule(str, enum.Enum):
    """How an MXFP4 block scale is derived from the block amax."""

    FLOOR = "floor"  # OCP spec: 2**(floor(log2(amax)) - 2); large mantissas saturate at 6
    CEIL = "ceil"  # 2**ceil(log2(amax / 6)): the smallest power of two that never saturates


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Value of each unpacked E2M1 code.

    Args:
        codes: uint8 tensor of any shape with values 0..15 (code 8 is -0.0).
    Returns:
        float32 tensor of the same shape.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"E2M1 codes must be uint8, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("E2M1 codes must be in 0..15 (unpacked); got a larger value")
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), device=codes.device)
    return table[codes.long()]


def e2m1_magnitude_code_rne(a: torch.Tensor) -> torch.Tensor:
    """Round non-negative float32 magnitudes (already clamped to [0, 6]) to E2M1 codes 0..7.

    Round to nearest, ties to even. Each tie point is compared with `>=` when rounding up
    lands on an even code (0.75, 1.75, 3.5) and `>` when it would land on an odd one
    (0.25, 1.25, 2.5, 5), so the sum of the seven comparisons is the code. The Triton
    kernels use the same seven comparisons, so both sides agree bit for bit.

    Args:
        a: float32 tensor, values in [0, 6].
    Returns:
        int32 tensor of the same shape, values 0..7.
    """
    return (
        (a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
        + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int()
    )


def e2m1_magnitude_code_floor(a: torch.Tensor) -> torch.Tensor:
    """Code of the largest E2M1 magnitude not above each `a` in [0, 6]. int32, same shape."""
    return (
        (a >= 0.5).int() + (a >= 1.0).int() + (a >= 1.5).int() + (a >= 2.0).int()
        + (a >= 3.0).int() + (a >= 4.0).int() + (a >= 6.0).int()
    )


def e2m1_magnitude_of_code(c: torch.Tensor) -> torch.Tensor:
    """Magnitude of magnitude-codes 0..7 (any integer dtype) as float32, same shape."""
    table = torch.tensor(E2M1_MAGNITUDES, device=c.device)
    return table[c.long()]


def e2m1_step_above(c: torch.Tensor) -> torch.Tensor:
    """Distance from magnitude-code c (0..6) to the next magnitude up: 0.5, 1 or 2. float32."""
    half, one, two = (torch.tensor(v, device=c.device) for v in (0.5, 1.0, 2.0))
    return torch.where(c < 4, half, torch.where(c < 6, one, two))


def float_to_e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to unpacked E2M1 codes (RNE, saturating at +-6).

    A negative value (or -0.0) keeps its sign bit even when it rounds to zero (code 8),
    as PTX `cvt.rn.satfinite.e2m1x2.f32` and torchao do.

    Args:
        v: float32 tensor of any shape, finite.
    Returns:
        uint8 tensor of the same shape, values 0..15.
    """
    a = v.abs().clamp(max=E2M1_MAX)
    sign = torch.signbit(v).to(torch.uint8) * E2M1_SIGN_BIT
    return e2m1_magnitude_code_rne(a).to(torch.uint8) | sign


def e4m3_to_float(scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its uint8 bits) to float32, same shape."""
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    return scales.to(torch.float32)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (uint8, 0..254; 255 is NaN) to float32 powers of two, same shape.

    Built from the float32 bit pattern (exponent field = byte), so it is exact on every
    device; byte 0 is 2**-127, the float32 subnormal 0x00400000.
    """
    if scales.dtype != torch.uint8:
        raise ValueError(f"E8M0 scales must be uint8, got {scales.dtype}")
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def div_exact(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """a / divisor as an IEEE division on every device.

    PyTorch's CUDA kernels turn division by a Python scalar into multiplication by its
    reciprocal, which can differ in the last bit; dividing by a same-device tensor does not.
    """
    return a / torch.full_like(a, divisor)
