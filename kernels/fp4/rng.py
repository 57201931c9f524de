"""Counter-based random numbers for stochastic rounding, identical on CPU and GPU.

Each element draws from a hash of (seed, flat element index), so the result depends on
neither the device, the launch grid nor the order of evaluation. The hash is Chris
Wellons' `lowbias32` (xor-shift-multiply); the torch version below keeps every
intermediate in int64 and multiplies in 16-bit halves so no step overflows, and the
Triton kernels run the same steps on uint32.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
HASH_MUL1 = 0x7FEB352D
HASH_MUL2 = 0x846CA68B
UNIFORM_BITS = 24  # uniforms k * 2**-24, exact in float32


def hash32_int(x: int) -> int:
    """lowbias32 on a Python int (host-side seed mixing)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * HASH_MUL1) & MASK32
    x ^= x >> 15
    x = (x * HASH_MUL2) & MASK32
    x ^= x >> 16
    return x


def seed_key(seed: int) -> int:
    """Mix a user seed (any Python int) into a 32-bit key."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"stochastic rounding seed must be an int, got {type(seed).__name__}")
    return hash32_int((seed & MASK32) ^ hash32_int(seed >> 32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x < 2**32 held in int64, without overflowing 64 bits.
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of 32-bit values; int64 result in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_MUL2)
    return x ^ (x >> 16)


def uniform_from_counter(index: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for each flat element index (int64 tensor, any shape), under a
    32-bit key: an int, or an int64 tensor broadcastable to index (one key per row, as sampling
    uses).

    r = hash32(lo32(index) ^ hash32(hi32(index) ^ key)); u = (r >> 8) * 2**-24.
    """
    lo, hi = index & MASK32, index >> 32
    r = hash32(lo ^ hash32(hi ^ key))
    return (r >> (32 - UNIFORM_BITS)).to(torch.float32) * 2.0**-UNIFORM_BITS
