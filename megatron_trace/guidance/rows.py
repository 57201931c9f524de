"""Guidance as row-aligned tensors: the form the trainer's FP4 sites consume.

A record (record.py) is the wire form of one (sample, layer, site); sparse records hold gap
streams that only make sense for the whole record. `RowGuidance` decodes a record into dense
tensors with one row per quantized row, so that a batch of samples can be concatenated, a
tensor-parallel rank can take its column slice, and expert-parallel dispatch can move each row
with its token (`to_row_bytes` / `from_row_bytes`). What a sparse record did not ship is marked
unknown and filled in by `resolve` from the trainer's own values, as `capture.guided_inputs`
describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from trace_kernels.fp4 import fake_quantize_guided, fake_quantize_partly_guided, resolve_partial

from .codec import GuidanceFormatError, decode_position_streams, pack_bits_at
from .record import Coding, GuidanceRecord


def _leading_bits(streams: list[torch.Tensor], counts: np.ndarray) -> torch.Tensor:
    """The first counts[i] bits of each packed bit stream streams[i] (uint8 [ceil(counts[i] / 8)],
    as GuidanceRecord checks), joined: uint8 [sum(counts)] of 0/1, unpacked in one call."""
    sizes = np.array([t.numel() for t in streams], dtype=np.int64)
    # numpy's unpackbits: torch's shift-and-mask broadcast took 5x as long; one torch.cat of the
    # flat streams, not ~10^4 numpy conversions
    flat = np.unpackbits(torch.cat(streams).cpu().numpy(), bitorder="little")
    first_bit = (np.cumsum(sizes) - sizes) * 8  # where each stream's bits start in `flat`
    taken = np.cumsum(counts) - counts
    index = np.arange(int(counts.sum())) + np.repeat(first_bit - taken, counts)
    return torch.from_numpy(flat[index])


@dataclass(frozen=True, kw_only=True)
class RowGuidance:
    """Guidance for R rows of K elements (row-scaled NVFP4, blocks of 16).

    g: float32 [R, 1], the engine's row global scales (always shipped).
    scales: uint8 [R, K/16], E4M3 block-scale bytes; with `scale_lsb` only bit 0 is meaningful
        (the trainer rounds its own scale to the neighbour with that last bit).
    scale_known: bool [R, K/16] or None (all known); where False the trainer's own scale is used.
    bits: uint8 [R, K/8], mantissa bits, element 8j+i of a row in bit i of byte j.
    bit_known: uint8 [R, K/8] packed like `bits`, or None (all known); where a bit is 0 the
        trainer's own round-to-nearest bit is used.
    row_ids: int64 [R] or None: each row's index in the micro-batch's site rows (kept through
        selection and dispatch, for metrics that compare with the engine row by row).
    """

    g: torch.Tensor
    scales: torch.Tensor
    bits: torch.Tensor
    scale_lsb: bool = False
    scale_known: torch.Tensor | None = None
    bit_known: torch.Tensor | None = None
    row_ids: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Rows the guidance covers."""
        return self.g.shape[0]

    @property
    def num_cols(self) -> int:
        return self.bits.shape[1] * 8

    @property
    def kind(self) -> tuple[bool, bool, bool, bool]:
        """What the rows carry; rows of different kinds cannot be concatenated."""
        return (self.scale_lsb, self.scale_known is not None, self.bit_known is not None, self.row_ids is not None)

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_record(cls, record: GuidanceRecord) -> RowGuidance:
        """Decode a record's payload into rows (on the payload's device, the CPU)."""
        h, p = record.header, record.payload
        if h.coding is not Coding.DENSE:
            return cls._from_sparse_records([record], h.cols, h.scale_coding == "lsb")
        return cls(g=p["g"].reshape(h.rows, 1).float(), scales=p["scales"].reshape(h.rows, h.cols // 16),
                   bits=p["bits"].reshape(h.rows, h.cols // 8))

    @classmethod
    def from_records(cls, records: list[GuidanceRecord]) -> RowGuidance:
        """The rows of several records, in order: `cat` of each one's `from_record`. Dense
        records are joined field by field with no RowGuidance each (a micro-batch joins ~10^4
        records a step: per-record objects cost ~1 s of host time on a 12-layer model)."""
        if not records:
            raise GuidanceFormatError("RowGuidance.from_records needs at least one record")
        cols = records[0].header.cols
        sparse = [r.header.coding is not Coding.DENSE for r in records]
        if any(sparse):
            lsb = {r.header.scale_coding == "lsb" for r in records}
            if all(sparse) and len(lsb) == 1 and all(r.header.cols == cols for r in records):
                return cls._from_sparse_records(records, cols, lsb.pop())
            return cls.cat([cls.from_record(r) for r in records])  # mixed kinds: cat names the mismatch
        if any(r.header.cols != cols for r in records):
            raise GuidanceFormatError(f"cannot concatenate guidance rows of widths "
                                      f"{sorted({r.header.cols for r in records})}")
        p = [r.payload for r in records]  # shapes checked by GuidanceRecord: g [R], scales [R, K/16], bits [R, K/8]
        return cls(g=torch.cat([x["g"] for x in p])[:, None], scales=torch.cat([x["scales"] for x in p]),
                   bits=torch.cat([x["bits"] for x in p]))

    @classmethod
    def _from_sparse_records(cls, records: list[GuidanceRecord], cols: int, scale_lsb: bool) -> RowGuidance:
        """`from_records` of sparse records of one width and scale coding, decoded together: the
        gap streams joined and decoded in one pass (each still checked whole), then one scatter
        and one pack for all (per record, ~20 small tensor ops cost ~0.5 ms, seconds a step on a
        12-layer model, and ten times that on a GPU's launch latency)."""
        rows = np.array([r.header.rows for r in records], dtype=np.int64)
        n_elems = np.array([r.header.n_elems for r in records], dtype=np.int64)
        numel, blocks = rows * cols, rows * (cols // 16)
        elem_start, block_start = np.cumsum(numel) - numel, np.cumsum(blocks) - blocks
        total_rows = int(rows.sum())
        g = torch.cat([r.payload["g"] for r in records]).float()[:, None]  # each [R], as GuidanceRecord checks
        # increasing: each record's positions, offset by the rows before it
        pos = (decode_position_streams([r.payload["elem_pos"] for r in records], n_elems, numel)
               + np.repeat(elem_start, n_elems))
        kept = _leading_bits([r.payload["elem_bits"] for r in records], n_elems).numpy()
        bits = torch.from_numpy(pack_bits_at(pos, total_rows * cols // 8, kept)).reshape(total_rows, cols // 8)
        known = torch.from_numpy(pack_bits_at(pos, total_rows * cols // 8)).reshape(total_rows, cols // 8)
        if scale_lsb:
            scales = _leading_bits([r.payload["scale_bits"] for r in records], blocks)
            scale_known = None
        else:
            n_scales = np.array([r.header.n_scales for r in records], dtype=np.int64)
            spos = torch.from_numpy(decode_position_streams([r.payload["scale_pos"] for r in records], n_scales, blocks)
                                    + np.repeat(block_start, n_scales))
            scales = torch.zeros(int(blocks.sum()), dtype=torch.uint8)
            scales[spos] = torch.cat([r.payload["scale_val"] for r in records])
            scale_known = torch.zeros(int(blocks.sum()), dtype=torch.bool)
            scale_known[spos] = True
            scale_known = scale_known.reshape(total_rows, cols // 16)
        return cls(g=g, scales=scales.reshape(total_rows, cols // 16), bits=bits, scale_lsb=scale_lsb,
                   scale_known=scale_known, bit_known=known)

    @classmethod
    def cat(cls, parts: list[RowGuidance]) -> RowGuidance:
        """Rows of several parts, in order. All parts must be of one kind and width."""
        if not parts:
            raise GuidanceFormatError("RowGuidance.cat needs at least one part")
        first = parts[0]
        for p in parts[1:]:
            if p.kind != first.kind or p.num_cols != first.num_cols:
                raise GuidanceFormatError(f"cannot concatenate guidance rows of kind {p.kind} x {p.num_cols} "
                                          f"with {first.kind} x {first.num_cols} (mixed codings or widths)")

        def cat_field(name):
            ts = [getattr(p, name) for p in parts]
            return None if ts[0] is None else torch.cat(ts)

        return cls(g=cat_field("g"), scales=cat_field("scales"), bits=cat_field("bits"), scale_lsb=first.scale_lsb,
                   scale_known=cat_field("scale_known"), bit_known=cat_field("bit_known"), row_ids=cat_field("row_ids"))

    def with_row_ids(self) -> RowGuidance:
        """The same rows, numbered 0..R-1."""
        return replace(self, row_ids=torch.arange(self.num_rows, device=self.g.device))

    # -- selecting -----------------------------------------------------------------------
    def _map(self, fn) -> RowGuidance:
        return replace(self, **{name: None if (t := getattr(self, name)) is None else fn(name, t)
                                for name in ("g", "scales", "bits", "scale_known", "bit_known", "row_ids")})

    def to(self, device) -> RowGuidance:
        """The same guidance with every tensor on `device` (copied without waiting)."""
        return self._map(lambda _, t: t.to(device, non_blocking=True))

    def select_rows(self, index: torch.Tensor | slice) -> RowGuidance:
        """Rows by index (an int64 tensor, possibly repeating rows) or slice."""
        return self._map(lambda _, t: t[index])

    def select_cols(self, start: int, end: int) -> RowGuidance:
        """Columns [start, end) of every row (a tensor-parallel shard); g stays the whole row's."""
        if start % 16 or end % 16 or not 0 <= start < end <= self.num_cols:
            raise GuidanceFormatError(f"column slice [{start}, {end}) of {self.num_cols}-wide guidance rows "
                                      "must be non-empty and on 16-element block boundaries")
        per_col = {"scales": 16, "scale_known": 16, "bits": 8, "bit_known": 8}
        return self._map(lambda name, t: t if name not in per_col
                         else t[:, start // per_col[name]: end // per_col[name]])

    # -- applying ------------------------------------------------------------------------
    @property
    def is_partial(self) -> bool:
        """True for sparse records' rows: they leave some scales or mantissa bits to the trainer."""
        return self.scale_lsb or self.scale_known is not None or self.bit_known is not None

    def _on(self, x_RK: torch.Tensor) -> RowGuidance:
        if tuple(x_RK.shape) != (self.num_rows, self.num_cols):
            raise GuidanceFormatError(f"guidance for {self.num_rows} x {self.num_cols} rows applied to "
                                      f"a tensor of shape {tuple(x_RK.shape)}")
        return self.to(x_RK.device)

    def resolve(self, x_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`quantize_guided`'s (g [R, 1], block scales float8_e4m3fn [R, K/16], bits uint8 [R, K/8])
        for the trainer's rows x_RK [R, K], on x's device (`trace_kernels.fp4.resolve_partial`)."""
        rg = self._on(x_RK)
        return resolve_partial(x_RK, rg.g, rg.scales, rg.bits, scale_lsb=rg.scale_lsb, scale_known=rg.scale_known,
                               bit_known=rg.bit_known)

    def fake_quantize(self, x_RK: torch.Tensor) -> torch.Tensor:
        """`fake_quantize_guided` of the trainer's rows x_RK [R, K] under this guidance, with the
        straight-through backward: [R, K] in x's dtype. Partial guidance is resolved inside the
        quantize kernel where it can be (BF16 rows on the Triton backend); no host sync."""
        rg = self._on(x_RK)
        if not rg.is_partial:
            return fake_quantize_guided(x_RK, rg.g, rg.scales.view(torch.float8_e4m3fn), rg.bits, check_finite=False)
        return fake_quantize_partly_guided(x_RK, rg.g, rg.scales, rg.bits, scale_lsb=rg.scale_lsb,
                                           scale_known=rg.scale_known, bit_known=rg.bit_known, check_finite=False)

    # -- moving with tokens ----------------------------------------------------------------
    def to_row_bytes(self) -> torch.Tensor:
        """uint8 [R, row_nbytes]: each row's guidance as bytes, to travel with its token."""
        fields = [self.g.contiguous().view(torch.uint8), self.scales]
        if self.scale_known is not None:
            fields.append(self.scale_known.to(torch.uint8))
        fields.append(self.bits)
        if self.bit_known is not None:
            fields.append(self.bit_known)
        if self.row_ids is not None:
            fields.append(self.row_ids.reshape(-1, 1).contiguous().view(torch.uint8))
        return torch.cat(fields, dim=1)

    @staticmethod
    def row_nbytes(cols: int, kind: tuple[bool, bool, bool, bool]) -> int:
        _, has_scale_known, has_bit_known, has_ids = kind
        return 4 + cols // 16 * (1 + has_scale_known) + cols // 8 * (1 + has_bit_known) + 8 * has_ids

    @classmethod
    def from_row_bytes(cls, data_RN: torch.Tensor, cols: int, kind: tuple[bool, bool, bool, bool]) -> RowGuidance:
        """Inverse of `to_row_bytes` for rows of `cols` elements of the given `kind`."""
        scale_lsb, has_scale_known, has_bit_known, has_ids = kind
        if data_RN.dim() != 2 or data_RN.shape[1] != cls.row_nbytes(cols, kind):
            raise GuidanceFormatError(f"guidance row bytes of shape {tuple(data_RN.shape)} do not hold "
                                      f"{cols}-wide rows of kind {kind}")
        widths = ([4, cols // 16] + [cols // 16] * has_scale_known + [cols // 8] + [cols // 8] * has_bit_known
                  + [8] * has_ids)
        parts = list(torch.split(data_RN, widths, dim=1))
        g = parts.pop(0).contiguous().view(torch.float32)
        scales = parts.pop(0)
        scale_known = parts.pop(0).bool() if has_scale_known else None
        bits = parts.pop(0)
        bit_known = parts.pop(0) if has_bit_known else None
        row_ids = parts.pop(0).contiguous().view(torch.int64).reshape(-1) if has_ids else None
        return cls(g=g, scales=scales, bits=bits, scale_lsb=scale_lsb, scale_known=scale_known, bit_known=bit_known,
                   row_ids=row_ids)
