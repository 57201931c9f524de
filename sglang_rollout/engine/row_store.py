"""The host rows a `generate` call has captured for its running sequences, until each finishes.

Every forward returns, per guided (layer, site), the rows of all its segments in one host array
(or the (bits, scales, g) parts of the fused quantize kernel), and the routed experts of every
token. A sequence's records need its rows of every step in token order. Slicing each step's
arrays per sequence, layer, site and part, then joining the slices at the end, cost ~1 s of host
time per RL step of a 12-layer model (128 samples, every layer guided; 27 000 slices a decode
step). Here each sequence owns a slot of `slot_tokens` tokens in one buffer per (key, part): a
step goes in with one indexed write per key and part, and a finished sequence comes out as one
contiguous slice each.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
import torch

from .sequence import Sequence

# a key's rows from one forward: a host tensor [rows, ...] or a tuple of them (its parts)
HostRows = torch.Tensor | tuple[torch.Tensor, ...]


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy view of a host tensor (BF16 through its int16 bits: numpy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class RowStore:
    """Rows per key (a (layer, site), or any hashable such as "experts") of the sequences being
    generated, `rows_per_token(key)` rows per token, at most `slot_tokens` tokens per sequence.
    A sequence gets its slot at its first write (`Sequence.row_slot`) and gives it back when its
    rows are taken or dropped; the buffers grow (doubling) when every slot is in use."""

    def __init__(self, slot_tokens: int, rows_per_token: Callable[[Hashable], int], slots: int = 16):
        if slot_tokens < 1:
            raise ValueError(f"RowStore needs slot_tokens >= 1, got {slot_tokens}")
        self.slot_tokens, self.rows_per_token = slot_tokens, rows_per_token
        self.num_slots = max(1, slots)
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.buffers: dict[Hashable, tuple[np.ndarray, ...]] = {}
        self.dtypes: dict[Hashable, tuple[torch.dtype, ...]] = {}
        self.parted: dict[Hashable, bool] = {}  # whether the key's rows come as a tuple of parts

    def write(self, rows: dict[Hashable, HostRows], segments: list[tuple[Sequence, int]]) -> None:
        """Append one forward's rows: `rows[key]` holds the rows of `segments` ((sequence, new
        tokens) in order) one after the other, rows_per_token(key) rows per token."""
        if self.buffers and rows.keys() != self.buffers.keys():
            raise RuntimeError(f"a forward captured rows of {sorted(map(str, rows))}, the ones before it of "
                               f"{sorted(map(str, self.buffers))}: every forward of a generate call captures the same")
        starts = []
        for seq, n in segments:
            if seq.row_slot < 0:
                seq.row_slot = self._acquire()
            if seq.rows_stored + n > self.slot_tokens:
                raise RuntimeError(f"sequence {seq.seq_id}: {seq.rows_stored + n} tokens of captured rows, more than "
                                   f"the {self.slot_tokens} its generate call allows (prompt + max_new_tokens)")
            starts.append(seq.row_slot * self.slot_tokens + seq.rows_stored)
            seq.rows_stored += n
        counts = np.array([n for _, n in segments], dtype=np.int64)
        # destination token of each new token: its slot's start + its offset in the segment
        tokens = np.repeat(np.array(starts, dtype=np.int64) - np.cumsum(counts) + counts, counts) \
            + np.arange(int(counts.sum()), dtype=np.int64)
        by_per: dict[int, np.ndarray] = {}
        for key, value in rows.items():
            per = self.rows_per_token(key)
            if per not in by_per:
                by_per[per] = tokens if per == 1 else (tokens[:, None] * per + np.arange(per)).reshape(-1)
            parts = value if isinstance(value, tuple) else (value,)
            buffers = self._buffers(key, parts, isinstance(value, tuple))
            for buf, part in zip(buffers, parts, strict=True):
                buf[by_per[per]] = _as_numpy(part)

    def take(self, seq: Sequence) -> dict[Hashable, HostRows]:
        """A sequence's rows per key, in token order (torch copies), and its slot given back."""
        out = {}
        if seq.row_slot >= 0:
            for key, buffers in self.buffers.items():
                per = self.rows_per_token(key)
                lo = seq.row_slot * self.slot_tokens * per
                parts = tuple(torch.from_numpy(buf[lo:lo + seq.rows_stored * per].copy()) for buf in buffers)
                parts = tuple(p.view(d) if d == torch.bfloat16 else p for p, d in zip(parts, self.dtypes[key],
                                                                                     strict=True))
                out[key] = parts if self.parted[key] else parts[0]
        self.drop(seq)
        return out

    def drop(self, seq: Sequence) -> None:
        """Give a sequence's slot back without reading it."""
        if seq.row_slot >= 0:
            self.free.append(seq.row_slot)
        seq.row_slot, seq.rows_stored = -1, 0

    def _acquire(self) -> int:
        if not self.free:
            grown = 2 * self.num_slots
            for key, buffers in self.buffers.items():
                self.buffers[key] = tuple(np.concatenate([b, np.empty_like(b)]) for b in buffers)
            self.free = list(range(grown - 1, self.num_slots - 1, -1))
            self.num_slots = grown
        return self.free.pop()

    def _buffers(self, key: Hashable, parts: tuple[torch.Tensor, ...], parted: bool) -> tuple[np.ndarray, ...]:
        if key not in self.buffers:
            rows = self.num_slots * self.slot_tokens * self.rows_per_token(key)
            self.buffers[key] = tuple(np.empty((rows, *p.shape[1:]), dtype=_as_numpy(p).dtype) for p in parts)
            self.dtypes[key], self.parted[key] = tuple(p.dtype for p in parts), parted
        return self.buffers[key]
