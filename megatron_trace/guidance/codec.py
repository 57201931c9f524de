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
    stream, _ = encode_position_lists(p, np.array([p.size]))
    return torch.from_numpy(stream)


def encode_position_lists(positions: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Several position lists encoded together (unchecked: each must be non-negative and strictly
    increasing, as a flatnonzero gives them).

    Args:
        positions: int64 [sum(counts)], list i's counts[i] positions after the lists before it.
    Returns:
        (uint8 [sum(sizes)]: the gap streams one after another, int64 sizes [len(counts)]).
    """
    counts = np.asarray(counts, dtype=np.int64)
    first = np.cumsum(counts) - counts
    prev = np.empty_like(positions)
    prev[1:] = positions[:-1]
    prev[first[counts > 0]] = -1  # each list's gaps start from p_{-1} = -1
    gaps = positions - prev - 1
    lengths = gaps // CONTINUE + 1
    out = np.full(int(lengths.sum()), CONTINUE, dtype=np.uint8)
    ends = np.cumsum(lengths)
    out[ends - 1] = (gaps % CONTINUE).astype(np.uint8)
    ends = np.concatenate(([0], ends))
    return out, ends[first + counts] - ends[first]


def pack_bits_at(pos: np.ndarray, nbytes: int, bits: np.ndarray | None = None) -> np.ndarray:
    """uint8 [nbytes]: bit p % 8 of byte p // 8 set for each position p of the sorted, distinct
    int64 `pos` (to bits[k] for the k-th, 0/1, when given), every other bit 0: pack_bits' layout,
    built in O(len(pos)) without the [nbytes * 8] array pack_bits would read (a sparse record
    keeps a few percent of its elements: building and packing the dense array was most of a
    trace-sparse step's trainer time, 2026-12-06)."""
    out = np.zeros(nbytes, dtype=np.uint8)
    if pos.size:
        byte = pos >> 3
        one = np.left_shift(np.uint8(1) if bits is None else bits.astype(np.uint8), (pos & 7).astype(np.uint8))
        first = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))  # sorted: a byte's bits are adjacent
        out[byte[first]] = np.add.reduceat(one, first)  # distinct bits: their sum is their OR
    return out


def decode_positions(stream: torch.Tensor, count: int, limit: int) -> torch.Tensor:
    """uint8 gap stream -> int64 positions [count], each < limit.

    Raises:
        GuidanceFormatError: a stream that does not hold exactly `count` positions below `limit`.
    """
    return torch.from_numpy(decode_position_streams([stream.detach().reshape(-1)], np.array([count]),
                                                    np.array([limit])))


def decode_position_streams(streams: list[torch.Tensor], counts: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Several gap streams decoded together: int64 [sum(counts)], stream i's counts[i] positions
    (each < limits[i]) after those of the streams before it, not offset. One pass over the joined
    bytes: a micro-batch decodes ~10^4 streams a step, and numpy's per-call cost, paid per stream,
    was most of a sparse step's trainer time.

    Raises:
        GuidanceFormatError: a stream that ends inside a gap, or does not hold exactly counts[i]
            positions below limits[i] (the message names the stream's index).
    """
    counts, limits = np.asarray(counts, dtype=np.int64), np.asarray(limits, dtype=np.int64)
    sizes = np.array([t.numel() for t in streams], dtype=np.int64)
    # flat uint8 streams (as GuidanceRecord checks): one cat, no per-stream reshape or copy
    s = torch.cat(streams).cpu().numpy().astype(np.int64) if streams else np.zeros(0, dtype=np.int64)
    starts, stops = np.cumsum(sizes) - sizes, np.cumsum(sizes)
    is_end = s != CONTINUE
    ends_before = np.concatenate(([0], np.cumsum(is_end)))  # gap ends among the first n bytes
    nonempty = np.flatnonzero(sizes > 0)
    if (bad := nonempty[~is_end[stops[nonempty] - 1]]).size:
        raise GuidanceFormatError(f"{_which(bad[0], len(streams))}position stream is truncated (ends inside a gap)")
    held = ends_before[stops] - ends_before[starts]
    if (bad := np.flatnonzero(held != counts)).size:
        i = bad[0]
        raise GuidanceFormatError(f"{_which(i, len(streams))}position stream holds {held[i]} positions, "
                                  f"header says {counts[i]}")
    # p_k = (the gaps up to k) + k within a stream: its bytes' running sum, less the sum before it
    before = np.concatenate(([0], np.cumsum(s)))
    stream_of = np.repeat(np.arange(len(streams)), counts)
    first = np.cumsum(counts) - counts
    p = before[np.flatnonzero(is_end) + 1] - before[starts][stream_of] + np.arange(int(counts.sum())) - first[stream_of]
    has = np.flatnonzero(counts > 0)
    last = p[first[has] + counts[has] - 1]
    if (bad := np.flatnonzero(last >= limits[has])).size:
        i = has[bad[0]]
        raise GuidanceFormatError(f"{_which(i, len(streams))}position {int(last[bad[0]])} is outside the record's "
                                  f"{limits[i]} entries")
    return p


def _which(i: int, n: int) -> str:
    """Which stream an error is about ("" when there is one)."""
    return "" if n == 1 else f"stream {i} of {n}: "
