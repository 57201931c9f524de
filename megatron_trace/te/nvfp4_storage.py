"""TRACE's NVFP4 tensors laid out as Transformer Engine's native `NVFP4TensorStorage` (row-wise),
the storage cuBLAS's FP4 GEMM reads on Blackwell, and back.

TE's layout (2.20.2, `NVFP4Quantizer.get_scale_shape`, `dequantize_nvfp4.cuh`):
- data: uint8 [M, K/2], the even element in the low nibble, E2M1 codes as TRACE's;
- scale_inv: E4M3 bytes as uint8 [round_up(M, 128), round_up(K/16, 4)], zero padding; compact
  row-major, or in cuBLAS's 128x4 tile order when `with_gemm_swizzled_scales`;
- amax: float32 (1,), or (M,) for row-scaled NVFP4 (TE 2.16+), and the element value is
  e2m1 * float(scale) * amax * (1 / 2688).
TRACE keeps the decode-direction global scale g (value = e2m1 * scale * g, g = amax / 2688), so
amax = g * 2688. Codes and block scales are carried bit for bit; TE's product order rounds the
global factor differently in the last bits of float32 (<= 2 ulp, tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trace_kernels.fp4 import QTensor
from trace_kernels.fp4.formats import NVFP4_GLOBAL_DENOM, Format


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def te_scale_shape(m: int, k: int) -> tuple[int, int]:
    """TE's row-wise NVFP4 scale_inv shape for M rows of K elements (padded to 128 x 4)."""
    return round_up(m, 128), round_up(-(-k // 16), 4)


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Padded compact scales [M, C] (M % 128 == 0, C % 4 == 0) in cuBLAS's block-scaling order:
    128 x 4 tiles, row-major over tiles, inside a tile the byte of (row r, column c) at
    (r % 32) * 16 + (r // 32) * 4 + c. Same shape and dtype."""
    m, c = s.shape
    if m % 128 or c % 4:
        raise ValueError(f"swizzle_scales needs [M % 128 == 0, C % 4 == 0], got {tuple(s.shape)}")
    return s.reshape(m // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4).reshape(m, c)


def unswizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Inverse of `swizzle_scales`."""
    m, c = s.shape
    return s.reshape(m // 128, c // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(m, c)


@dataclass(frozen=True)
class TENVFP4Rowwise:
    """The row-wise fields of a TE `NVFP4TensorStorage` (its constructor's keyword names)."""

    rowwise_data: torch.Tensor  # uint8 [M, K/2]
    rowwise_scale_inv: torch.Tensor  # uint8 [round_up(M, 128), round_up(K/16, 4)]
    amax_rowwise: torch.Tensor  # float32 (1,) or (M,)
    row_scaled_nvfp4: bool
    with_gemm_swizzled_scales: bool
    shape: torch.Size  # the logical shape [..., K]


def to_te_nvfp4(q: QTensor, *, swizzle: bool = False) -> TENVFP4Rowwise:
    """q (NVFP4, per-tensor or per-row global scale, any leading dims) as TE's row-wise fields.
    Codes are shared with q (no copy); scales are copied into TE's padded layout."""
    if q.fmt is not Format.NVFP4:
        raise ValueError(f"to_te_nvfp4: TE's NVFP4 storage holds NVFP4, got {q.fmt.value}")
    rows = q.rows()
    m, k = rows.codes.shape[0], q.shape[-1]
    scales = torch.zeros(te_scale_shape(m, k), dtype=torch.uint8, device=q.device)
    scales[:m, : k // 16] = rows.block_scales.view(torch.uint8)
    if swizzle:
        scales = swizzle_scales(scales)
    g = rows.global_scale.reshape(-1 if q.is_row_scaled else 1)
    return TENVFP4Rowwise(rows.codes, scales, g * NVFP4_GLOBAL_DENOM, q.is_row_scaled, swizzle, q.shape)


def from_te_nvfp4(f: TENVFP4Rowwise) -> QTensor:
    """TE's row-wise fields back as a QTensor of f.shape (the inverse of `to_te_nvfp4`)."""
    k = f.shape[-1]
    m = f.rowwise_data.shape[0]
    scales = unswizzle_scales(f.rowwise_scale_inv) if f.with_gemm_swizzled_scales else f.rowwise_scale_inv
    if tuple(scales.shape) != te_scale_shape(m, k):
        raise ValueError(f"TE NVFP4 scale_inv {tuple(scales.shape)} for {m} rows of {k}: "
                         f"expected {te_scale_shape(m, k)}")
    lead = tuple(f.shape[:-1])
    g = f.amax_rowwise / NVFP4_GLOBAL_DENOM
    g = g.reshape(*lead, 1) if f.row_scaled_nvfp4 else g.reshape(())
    return QTensor(f.rowwise_data.reshape(*lead, k // 2),
                   scales[:m, : k // 16].contiguous().view(torch.float8_e4m3fn).reshape(*lead, k // 16),
                   g, Format.NVFP4, torch.Size(f.shape))
