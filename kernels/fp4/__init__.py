"""The FP4 numerics shared bit for bit by trainer and engine (docs/design.md section 2).

Layers, bottom up: `formats` (element and scale codecs), `packing`, `reference` (torch
specification), `triton_fp4` (GPU kernels equal to the reference), `qtensor`, `clip_mask`
(when a straight-through mask is known all true, without a host sync), `api`,
`partial_guidance` (sparse records' guidance applied in the same kernels). The decode
kernels sit on top: `linear` (FP4-weight GEMMs), `paged_attention` (FP4 KV cache), and
`cuda_decode` (CUDA C++ versions of both for Hopper, compiled by NVRTC at first use).
"""

from .api import (
    amax,
    block_clip_bound,
    dequantize,
    fake_quantize,
    fake_quantize_guided,
    fake_quantize_guided_ste,
    fake_quantize_rows,
    fake_quantize_ste,
    fake_quantize_ste_flagged,
    quantize,
    quantize_guided,
    quantize_rows_into,
)
from .clip_mask import ClipMask
from .formats import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E4M3_MAX,
    Format,
    MXScaleRule,
    e2m1_to_float,
    e4m3_to_float,
    e8m0_to_float,
    float_to_e2m1_rne,
)
from .packing import mantissa_bits, pack_bits, pack_codes, unpack_bits, unpack_codes
from .partial_guidance import fake_quantize_partly_guided, resolve_partial
from .qtensor import QTensor

__all__ = [
    "ClipMask",
    "E2M1_MAGNITUDES",
    "E2M1_MAX",
    "E4M3_MAX",
    "Format",
    "MXScaleRule",
    "QTensor",
    "amax",
    "block_clip_bound",
    "dequantize",
    "e2m1_to_float",
    "e4m3_to_float",
    "e8m0_to_float",
    "fake_quantize",
    "fake_quantize_guided",
    "fake_quantize_guided_ste",
    "fake_quantize_partly_guided",
    "fake_quantize_rows",
    "fake_quantize_ste",
    "fake_quantize_ste_flagged",
    "float_to_e2m1_rne",
    "mantissa_bits",
    "pack_bits",
    "pack_codes",
    "quantize",
    "quantize_guided",
    "quantize_rows_into",
    "resolve_partial",
    "unpack_bits",
    "unpack_codes",
]
