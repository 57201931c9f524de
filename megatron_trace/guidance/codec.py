"""Compact encodings for sparse guidance: sorted positions as byte gap streams.

A position list p_0 < p_1 < ... is stored as gaps (p_k - p_{k-1} - 1, with p_{-1} = -1), each
gap written as floor(gap / 255) bytes of 255 followed by one byte gap % 255. At a few
percent of kept elements most gaps fit one byte, so a position costs ~8 bits.
"""

from __future__ import annotations

import numpy as np
import torch

CONTINUE = 255


class GuidanceFormatError(ValueError):
    """A guidance record or stream that is malformed, truncated, corrupted or does not fit."""


def encode_positions(positions: torch.Tensor) -> torch.Tensor:
    """Strictly increasing int64 positions [N] -> uint8 gap stream [>= N]."""
    p = positions.detach().cpu().numpy().astype(np.int64)
    if p.size and (p[0] < 0 or np.any(np.diff(p) <= 0)):
        raise GuidanceFormatError("positions must be non-negative and strictly increasing")
    gaps = np.diff(p, prepend=-1) - 1
    n_full = gaps // CONTINUE
    lengths = n_full + 1
    out = np.full(int(lengths.sum()), CONTINUE, dtype=np.uint8)
    out[np.cumsum(lengths) - 1] = (gaps % CONTINUE).astype(np.uint8)
    return torch.from_numpy(out)


def decode_positions(stream: torch.Tensor, count: int, limit: int) -> torch.Tensor:
    """uint8 gap stream -> int64 positions [count], each < limit.

    Raises:
        GuidanceFormatError: a stream that does not hold exactly `count` positions below `limit`.
    """
    s = stream.detach().cpu().numpy().astype(np.int64)
    if s.size and s[-1] == CONTINUE:
        raise GuidanceFormatError("position stream is truncated (ends inside a gap)")
    ends = np.flatnonzero(s != CONTINUE)
    if ends.size != count:
        raise GuidanceFormatError(f"position stream holds {ends.size} positions, header says {count}")
    p = np.cumsum(s)[ends] + np.arange(count)
    if count and p[-1] >= limit:
        raise GuidanceFormatError(f"position {int(p[-1])} is outside the record's {limit} entries")
    return torch.from_numpy(p)
