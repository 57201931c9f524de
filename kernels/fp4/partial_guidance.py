"""Partial guidance: the engine's block scales and mantissa bits for some blocks and elements
only (TRACE's sparse records), the rows' own rounding for the rest.

A block scale is either given where `scale_known` says so (the rows' own RNE scale elsewhere),
or, with `scale_lsb`, the rows' own scale rounded to the E4M3 code whose last bit is the given
one. A mantissa bit is given where `bit_known` says so; elsewhere the element rounds to nearest
(the guided code under the RNE code's own bit is that code). `resolve_partial` is the torch
definition; `fake_quantize_partly_guided` applies it in one kernel pass for BF16 rows on the
Triton backend (`triton_fp4._quantize_bf16_kernel`, SCALE_RULE and BITS_KNOWN), where the
torch path costs about 75 small ops a call.
"""

from __future__ import annotations

import torch

from .api import (
    _fake_quantize_guided_ste,
    _FakeQuantizeSTE,
    _fusable,
    _raise_nonfinite,
    _wants_grad,
    triton_fp4,
)
from .packing import pack_bits
from .reference import (
    nvfp4_block_amax,
    nvfp4_block_scales,
    nvfp4_block_scales_guided,
    nvfp4_scaled_values,
    round_scaled_to_e2m1,
)


def _check(x_RK, g, scales, bits, scale_lsb, scale_known, bit_known) -> None:
    r, k = x_RK.shape
    want = {"g": (g, torch.float32, (r, 1)), "scales": (scales, torch.uint8, (r, k // 16)),
            "bits": (bits, torch.uint8, (r, k // 8))}
    if scale_known is not None:
        want["scale_known"] = (scale_known, torch.bool, (r, k // 16))
    if bit_known is not None:
        want["bit_known"] = (bit_known, torch.uint8, (r, k // 8))
    if k % 16:
        raise ValueError(f"partial guidance: rows of {k} elements are not whole 16-element blocks")
    for name, (t, dtype, shape) in want.items():
        if t.dtype != dtype or tuple(t.shape) != shape or t.device != x_RK.device:
            raise ValueError(f"partial guidance: {name} must be {dtype} {shape} on {x_RK.device} for rows of shape "
                             f"{tuple(x_RK.shape)}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if scale_lsb and scale_known is not None:
        raise ValueError("partial guidance: scale_lsb and scale_known are two codings of the scales; give one")


def resolve_partial(x_RK: torch.Tensor, g: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, *,
                    scale_lsb: bool = False, scale_known: torch.Tensor | None = None,
                    bit_known: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The complete guidance partial guidance stands for, on the rows x_RK [R, K].

    Args:
        g: float32 [R, 1], the engine's row global scales (always given).
        scales: uint8 [R, K/16] E4M3 bytes (with scale_lsb only their last bits count).
        bits: uint8 [R, K/8] mantissa bits, element 8j+i in bit i of byte j.
        scale_lsb / scale_known (bool [R, K/16]): how the scales are given; neither: all given.
        bit_known: uint8 [R, K/8], set where the bit is given; None: all given.
    Returns:
        (g, block scales float8_e4m3fn [R, K/16], mantissa bits uint8 [R, K/8]): what
        `quantize_guided` takes.
    """
    _check(x_RK, g, scales, bits, scale_lsb, scale_known, bit_known)
    if scale_lsb:
        s = nvfp4_block_scales_guided(nvfp4_block_amax(x_RK), g, scales & 1)
    elif scale_known is None:
        s = scales.view(torch.float8_e4m3fn)
    else:
        own = nvfp4_block_scales(nvfp4_block_amax(x_RK), g).view(torch.uint8)
        s = torch.where(scale_known, scales, own).view(torch.float8_e4m3fn)
    if bit_known is None:
        return g, s, bits
    # as bools: packed without a host synchronisation
    own_bits = pack_bits((round_scaled_to_e2m1(nvfp4_scaled_values(x_RK, g, s)) & 1).bool())
    return g, s, (bits & bit_known) | (own_bits & ~bit_known)


def fake_quantize_partly_guided(x_RK: torch.Tensor, g: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, *,
                                scale_lsb: bool = False, scale_known: torch.Tensor | None = None,
                                bit_known: torch.Tensor | None = None, backend: str = "auto",
                                check_finite: bool = True) -> torch.Tensor:
    """`fake_quantize_guided` of rows x_RK [R, K] under `resolve_partial`'s guidance (arguments
    as there), with its straight-through backward: x's shape and dtype. One kernel for BF16 rows
    on the Triton backend. check_finite: refuse NaN or Inf in x (one host sync on a GPU)."""
    _check(x_RK, g, scales, bits, scale_lsb, scale_known, bit_known)
    with_mask = _wants_grad(x_RK)
    bits_c = bits.contiguous()
    known_c = None if bit_known is None else bit_known.contiguous()

    def fused(t):
        rule = (triton_fp4.SCALES_BY_LSB if scale_lsb else triton_fp4.SCALES_GIVEN if scale_known is None
                else triton_fp4.SCALES_WHERE_KNOWN)
        out, inside, _, _, bad, all_inside = triton_fp4.fake_quantize_partly_guided_bf16_triton(
            t.contiguous(), g.reshape(-1).contiguous(), scales.contiguous(), bits_c, rule,
            None if scale_known is None else scale_known.contiguous().view(torch.uint8), known_c,
            with_mask=with_mask, with_answer=with_mask)
        if check_finite and bool(bad.any()):
            _raise_nonfinite("detected by the Triton kernel")
        return out, inside, all_inside

    def unfused(t):
        guidance = resolve_partial(t, g, scales, bits, scale_lsb=scale_lsb, scale_known=scale_known,
                                   bit_known=bit_known)
        return _fake_quantize_guided_ste(t, *guidance, backend=backend, check_finite=check_finite,
                                         with_mask=with_mask, answer=with_mask)

    # _fusable first: without Triton (or off its backend) triton_fp4 may be None; the kernel
    # takes x contiguous (`fused` copies it where it is not)
    fuse = _fusable(x_RK, backend) and all(triton_fp4.fusable(x_RK.contiguous(), b)
                                           for b in (bits_c, known_c) if b is not None)
    return _FakeQuantizeSTE.apply(x_RK, fused if fuse else unfused)
