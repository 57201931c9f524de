"""Packing of 4-bit codes two per byte, and of single bits eight per byte.

Nibble order: the even-index element goes in the low nibble, as ModelOpt, compressed-tensors,
torchao and PyTorch's float4_e2m1fn_x2 store it. Bit order: element 8*j + i in bit i of
byte j, as numpy.packbits(..., bitorder="little").
"""

from __future__ import annotations

import torch


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack unpacked 4-bit codes two per byte along the last dimension.

    Args:
        codes: uint8 [..., K] with values 0..15, K even.
    Returns:
        uint8 [..., K/2]; element 2i in the low nibble of byte i, element 2i+1 in the high one.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_codes needs uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_codes needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("pack_codes got a code above 15: codes must be unpacked 4-bit values")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [..., K/2] -> uint8 [..., K] with values 0..15."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_codes needs uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack booleans (or 0/1 integers) eight per byte along the last dimension.

    Args:
        bits: bool or integer [..., N] of 0/1, N a multiple of 8. Integer values are checked
            (one host synchronisation on the GPU); bools are 0/1 by construction and are not.
    Returns:
        uint8 [..., N/8]; element 8j+i in bit i of byte j (little-endian bit order).
    """
    if bits.dim() == 0 or bits.shape[-1] % 8:
        raise ValueError(f"pack_bits needs a last dimension divisible by 8, got {tuple(bits.shape)}")
    b = bits.to(torch.uint8).reshape(*bits.shape[:-1], -1, 8)
    if bits.dtype != torch.bool and b.numel() and int(b.max()) > 1:
        raise ValueError("pack_bits got a value other than 0 or 1")
    # shifts made on the device: a constant tensor would be a pageable host-to-device copy, which
    # CUDA graph capture refuses (SGLang's decode graphs pack the sparse guidance's bits)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (b << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 [..., N/8] -> uint8 [..., N] of 0/1."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_bits needs uint8, got {packed.dtype}")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def mantissa_bits(packed: torch.Tensor) -> torch.Tensor:
    """Each element's mantissa bit (code & 1) packed eight per byte, what a dense guidance record
    keeps: `pack_bits(unpack_codes(packed) & 1)` without `pack_bits`' value check, whose host
    synchronisation a CUDA graph cannot capture (the bits are 0/1 by construction).

    Args:
        packed: uint8 [..., K/2] packed codes, K a multiple of 8.
    Returns:
        uint8 [..., K/8].
    """
    if packed.dtype != torch.uint8 or packed.dim() == 0 or packed.shape[-1] % 4:
        raise ValueError(f"mantissa_bits needs packed uint8 codes [..., K/2] with K % 8 == 0, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    bits = torch.stack((packed & 1, (packed >> 4) & 1), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] // 4, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)  # made on the device: no copy
    return (bits << shifts).sum(-1, dtype=torch.uint8)
