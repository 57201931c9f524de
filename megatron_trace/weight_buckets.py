"""Weight buckets: how weights travel from the trainer to the engines, in flat buffers of bounded
size, each weight whole or as slices of its full (unsharded) tensor.

A bucket is one flat uint8 tensor, self-describing:

    [u64 little-endian H][H bytes of JSON header][pad to ALIGN][part 0][pad]...[part n-1][pad]

The header is {"format": FORMAT, "pieces": [[name, kind, dim, start, shape, full_shape], ...]}.
A piece is full[start : start + shape[dim]] along `dim` (every other dimension whole) of the
weight `name` (full Megatron name) of shape `full_shape`; `kind` is the dtype name of plain
values ("bfloat16", "float32") or "nvfp4" for packed FP4, whose parts are the codes uint8
[..., k/2], the block scales uint8 (E4M3 bits) [..., k/16] and the global scale float32 [1] of
the *whole* tensor (docs/design.md section 2). Parts follow in piece order, each at a multiple
of ALIGN bytes (`bucket_layout`).

Senders cut their pieces (`Buckets`) so that a bucket's parts take at most max_bytes; the
receiver checks each piece (`Coverage`: a known weight, its shape, in bounds, never twice; at
the end every weight complete) and writes it in place (`write_piece`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from trace_kernels.fp4 import Format, QTensor, quantize

from .model_config import FP4_WEIGHT_SUFFIXES

FORMAT = 1
ALIGN = 16  # bytes: every part starts at a multiple of this (any dtype's view)
NVFP4 = "nvfp4"
_PREFIX = 8  # the u64 header length
# Host bytes per element the torch reference quantizer holds at its peak (measured 22-28 on
# 1-4 M elements): FP4 chunks are cut so that quantizing one takes at most a bucket's bytes.
QUANTIZE_WORK_BYTES = 32


def bucket_layout(dtypes: list, shapes: list) -> tuple[list[int], int]:
    """Byte offset of each tensor in a flat bucket, and the bucket's size (the same on both sides)."""
    offsets, size = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offsets.append(size)
        size += _aligned(math.prod(shape) * _dtype(dtype).itemsize)
    return offsets, size


@dataclass(frozen=True)
class Piece:
    """A slice of one full weight: full[start : start + shape[dim]] along `dim`, the other
    dimensions whole. kind: "nvfp4" (packed) or the dtype name of plain values."""

    name: str
    kind: str
    dim: int
    start: int
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]

    @classmethod
    def whole(cls, name: str, t: torch.Tensor | QTensor) -> Piece:
        """All of `t` (a packed QTensor: nvfp4) as one piece."""
        kind = NVFP4 if isinstance(t, QTensor) else str(t.dtype).removeprefix("torch.")
        return cls(name, kind, 0, 0, tuple(t.shape), tuple(t.shape))

    @property
    def length(self) -> int:
        return self.shape[self.dim]

    @property
    def parts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype name, shape) of each tensor the piece carries."""
        if self.kind != NVFP4:
            return [(self.kind, self.shape)]
        *lead, k = self.shape
        return [("uint8", (*lead, k // 2)), ("uint8", (*lead, k // 16)), ("float32", (1,))]

    @property
    def nbytes(self) -> int:
        """Bytes of its parts in a bucket (aligned)."""
        return bucket_layout(*zip(*self.parts, strict=True))[1]

    def narrow(self, start: int, length: int) -> Piece:
        """The sub-slice [start, start + length) along `dim`, in full-tensor coordinates."""
        shape = list(self.shape)
        shape[self.dim] = length
        return dataclasses.replace(self, start=start, shape=tuple(shape))

    def split(self, max_bytes: int, quantizes: bool = False) -> list[Piece]:
        """Consecutive sub-slices along `dim` whose parts take at most max_bytes each (packed
        FP4 along the last dimension in whole 16-element blocks; with `quantizes`, FP4 slices
        also small enough to quantize within max_bytes, see QUANTIZE_WORK_BYTES); a single row
        or block larger than that alone."""
        unit = 16 if self.kind == NVFP4 and self.dim == len(self.shape) - 1 else 1
        slab = math.prod(self.narrow(self.start, unit).shape)  # elements per unit
        per_unit = slab * 9 // 16 if self.kind == NVFP4 else slab * _dtype(self.kind).itemsize  # codes + scales
        step = max(1, (max_bytes - ALIGN * len(self.parts)) // per_unit)  # each part pads < ALIGN; g fits in one
        if quantizes and self.kind == NVFP4:
            step = min(step, max(1, max_bytes // (QUANTIZE_WORK_BYTES * slab)))
        n = self.length // unit
        return [self.narrow(self.start + i * unit, min(step, n - i) * unit) for i in range(0, n, step)]

    def to_json(self) -> list:
        return [self.name, self.kind, self.dim, self.start, list(self.shape), list(self.full_shape)]


@dataclass(frozen=True)
class Source:
    """What a sender holds of one weight: the values of `piece` (`values.narrow(piece.dim, 0,
    piece.length)` is all of it). A packed piece comes from a QTensor as it is, or from plain
    values quantized on the way with `amax`, the whole logical tensor's amax."""

    piece: Piece
    values: torch.Tensor | QTensor
    amax: torch.Tensor | None = None

    def parts_of(self, sub: Piece) -> list[torch.Tensor]:
        """The tensors of `sub` (a sub-slice of this source's piece), as a bucket carries them."""
        offset = sub.start - self.piece.start
        if self.piece.kind != NVFP4:
            return [self.values.narrow(sub.dim, offset, sub.length)]
        if isinstance(self.values, QTensor):
            q = self.values
            codes, scales = _narrow_packed(q.codes, q.block_scales.view(torch.uint8), sub.dim, offset, sub.length)
        else:
            # finite: `Buckets` checked the amax, and a NaN or Inf anywhere makes it so
            q = quantize(self.values.narrow(sub.dim, offset, sub.length), "nvfp4", global_amax=self.amax,
                         check_finite=False)
            codes, scales = q.codes, q.block_scales.view(torch.uint8)
        return [codes, scales, q.global_scale.reshape(1)]


class Buckets:
    """Sources cut into buckets of at most max_bytes of parts each (plus the header, about
    100 bytes a piece), made one at a time as they are iterated: a sized iterable of flat
    uint8 tensors on `device`. `nbytes`: the bytes of the buckets made so far. ValueError
    naming the weights whose amax is not finite (NaN or Inf in them): nothing is sent then."""

    def __init__(self, sources: list[Source], max_bytes: int, device=None):
        if max_bytes < 1:
            raise ValueError(f"weight buckets: max_bytes must be >= 1, got {max_bytes}")
        quantized = [s for s in sources if s.amax is not None]
        if quantized:  # one host synchronisation for all of them
            finite = torch.isfinite(torch.stack([s.amax.reshape(()) for s in quantized])).tolist()
            bad = sorted({s.piece.name for s, ok in zip(quantized, finite, strict=True) if not ok})
            if bad:
                raise ValueError(f"weight sync: {len(bad)} weights hold NaN or Inf, e.g. {bad[:5]}")
        self.device = device if device is not None else (sources[0].values.device if sources else "cpu")
        self.plan: list[list[tuple[Source, Piece]]] = [[]]
        size = 0
        for src in sources:
            for sub in src.piece.split(max_bytes, quantizes=not isinstance(src.values, QTensor)):
                if self.plan[-1] and size + sub.nbytes > max_bytes:
                    self.plan.append([])
                    size = 0
                self.plan[-1].append((src, sub))
                size += sub.nbytes
        self.plan = [b for b in self.plan if b]
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for group in self.plan:
            flat = self._make(group)
            self.nbytes += flat.numel()
            yield flat
            del flat  # before the next one is made

    def _make(self, group: list[tuple[Source, Piece]]) -> torch.Tensor:
        flat, views = new_bucket([sub for _, sub in group], self.device)
        for (src, sub), targets in zip(group, views, strict=True):
            for target, part in zip(targets, src.parts_of(sub), strict=True):
                target.copy_(part)
        return flat


def state_dict_buckets(state_dict: dict, max_bytes: int, fp4: bool = False) -> Buckets:
    """A full state dict (tensors, packed FP4 weights as QTensors) as buckets. fp4: for an FP4
    receiver, plain weights at FP4 sites are packed on the way (a receiver cannot quantize a
    slice of a tensor by itself)."""
    sources = []
    for name, t in state_dict.items():
        if fp4 and not isinstance(t, QTensor) and name.endswith(FP4_WEIGHT_SUFFIXES):
            sources.append(Source(dataclasses.replace(Piece.whole(name, t), kind=NVFP4), t, amax_of(t)))
        else:
            sources.append(Source(Piece.whole(name, t), t))
    return Buckets(sources, max_bytes)


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 0-d tensor, without a temporary of t's size; Inf when t holds a NaN
    or an Inf (so that a MAX reduction over shards keeps it)."""
    lo, hi = torch.aminmax(t)
    return torch.nan_to_num(torch.maximum(-lo, hi).float(), nan=float("inf"))


def new_bucket(pieces: list[Piece], device) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """A zeroed bucket for `pieces`, its header written, and views of each piece's parts to fill."""
    header = json.dumps({"format": FORMAT, "pieces": [p.to_json() for p in pieces]}).encode()
    start = _aligned(_PREFIX + len(header))
    dtypes, shapes = zip(*[part for p in pieces for part in p.parts], strict=True) if pieces else ((), ())
    offsets, size = bucket_layout(list(dtypes), list(shapes))
    flat = torch.zeros(start + size, dtype=torch.uint8, device=device)
    flat[:start].copy_(_bytes_tensor(len(header).to_bytes(_PREFIX, "little") + header, start))
    views, i = [], 0
    for p in pieces:
        n = len(p.parts)
        views.append([_view(flat, start + offsets[j], dtypes[j], shapes[j]) for j in range(i, i + n)])
        i += n
    return flat, views


def read_bucket(flat: torch.Tensor) -> list[tuple[Piece, list[torch.Tensor]]]:
    """A bucket's pieces with views of their parts. ValueError for a malformed bucket."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < _PREFIX:
        raise ValueError(f"weight bucket: expected a flat uint8 tensor of at least {_PREFIX} bytes, got "
                         f"{flat.dtype} {tuple(flat.shape)}")
    h = int.from_bytes(flat[:_PREFIX].cpu().numpy().tobytes(), "little")
    start = _aligned(_PREFIX + h)
    if start > flat.numel():
        raise ValueError(f"weight bucket of {flat.numel()} bytes is truncated inside its {h}-byte header")
    try:
        meta = json.loads(flat[_PREFIX:_PREFIX + h].cpu().numpy().tobytes())
        pieces = [Piece(n, k, int(d), int(s), tuple(shape), tuple(full)) for n, k, d, s, shape, full in meta["pieces"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"weight bucket: unreadable header ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"weight bucket format {meta.get('format')!r}, this build reads {FORMAT}")
    parts = [part for p in pieces for part in p.parts]
    dtypes, shapes = zip(*parts, strict=True) if parts else ((), ())
    offsets, size = bucket_layout(list(dtypes), list(shapes))
    if flat.numel() != start + size:
        raise ValueError(f"weight bucket of {flat.numel()} bytes, its header ({len(pieces)} pieces) says "
                         f"{start + size}")
    out, i = [], 0
    for p in pieces:
        n = len(p.parts)
        out.append((p, [_view(flat, start + offsets[j], dtypes[j], shapes[j]) for j in range(i, i + n)]))
        i += n
    return out


class Coverage:
    """What one update has delivered, checked piece by piece against the receiver's weights
    (`shapes`: full name -> full shape; `packed(name)`: whether it holds that weight in FP4).
    Every check raises ValueError naming the weight."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], packed: Callable[[str], bool]):
        self.shapes, self.packed = shapes, packed
        self.spans: dict[str, list[tuple[int, int, int]]] = {}  # name -> (dim, start, stop) arrived
        self.global_scales: dict[str, float] = {}

    def add(self, pieces: list[tuple[Piece, list[torch.Tensor]]]) -> None:
        """Record a bucket's pieces with their parts (a packed slice's global scale must be that
        of the other slices of its tensor), all checked before any is recorded."""
        for piece, _ in pieces:
            self.check(piece)
        packed = [(piece.name, parts[2]) for piece, parts in pieces if piece.kind == NVFP4]
        scales = torch.cat([g.reshape(1) for _, g in packed]).cpu().tolist() if packed else []  # one copy a bucket
        for (name, _), g in zip(packed, scales, strict=True):
            if self.global_scales.setdefault(name, g) != g:
                raise ValueError(f"weight update: {name}: a slice's global scale {g!r} differs from another's "
                                 f"{self.global_scales[name]!r} (amax not reduced over the shards?)")
        for piece, _ in pieces:
            self._add_span(piece)

    def check(self, piece: Piece) -> None:
        """ValueError naming the weight when `piece` does not fit the receiver's weights."""
        name, full = piece.name, self.shapes.get(piece.name)
        if full is None:
            raise ValueError(f"weight update: unknown tensor {name!r}")
        if piece.full_shape != tuple(full):
            raise ValueError(f"weight update: {name} has shape {piece.full_shape}, the model's is {tuple(full)}")
        fits = (len(piece.shape) == len(full) and 0 <= piece.dim < len(full) and piece.length >= 1
                and all(piece.shape[d] == full[d] for d in range(len(full)) if d != piece.dim)
                and piece.start >= 0 and piece.start + piece.length <= full[piece.dim])
        if not fits:
            raise ValueError(f"weight update: {name}: a slice from {piece.start} along dim {piece.dim} of shape "
                             f"{piece.shape} does not fit its shape {tuple(full)}")
        if self.packed(name):
            if piece.kind != NVFP4 and piece.shape != full:
                raise ValueError(f"weight update: {name} arrived as a {piece.kind} slice; the engine holds it in "
                                 "FP4 and quantizes only whole tensors itself (send it packed)")
            if piece.kind == NVFP4 and piece.dim == len(full) - 1 and (piece.start % 16 or piece.length % 16):
                raise ValueError(f"weight update: {name}: packed slice [{piece.start}:{piece.start + piece.length}] "
                                 "does not fall on 16-element blocks")
        elif piece.kind == NVFP4:
            raise ValueError(f"weight update: {name} arrived as FP4, but the engine holds it in BF16")

    def _add_span(self, piece: Piece) -> None:
        lo, hi = piece.start, piece.start + piece.length
        spans = self.spans.setdefault(piece.name, [])
        for dim, a, b in spans:
            if dim != piece.dim:
                raise ValueError(f"weight update: {piece.name} arrived sliced along dims {dim} and {piece.dim}")
            if a < hi and lo < b:
                raise ValueError(f"weight update: {piece.name} [{lo}:{hi}] of dim {dim} arrived twice "
                                 f"(overlaps [{a}:{b}])")
        spans.append((piece.dim, lo, hi))

    def missing(self) -> list[str]:
        """Weights not (completely) delivered, in the model's order."""
        out = []
        for name, full in self.shapes.items():
            spans = self.spans.get(name)
            if not spans or sum(b - a for _, a, b in spans) != full[spans[0][0]]:
                out.append(name)
        return out

    def check_complete(self) -> None:
        """ValueError naming the weights an update left out or incomplete."""
        missing = self.missing()
        if missing:
            raise ValueError(f"weight update incomplete: {len(missing)} weights missing or partial, e.g. "
                             f"{missing[:5]}")


def parts_of_whole(t: torch.Tensor | QTensor) -> list[torch.Tensor]:
    """The parts of `Piece.whole(name, t)`: a tensor-scaled QTensor's codes, block scale bytes
    and global scale, or the tensor itself."""
    if isinstance(t, QTensor):
        return [t.codes, t.block_scales.view(torch.uint8), t.global_scale.reshape(1)]
    return [t]


def write_piece(held: torch.Tensor | QTensor, piece: Piece, parts: list[torch.Tensor]) -> None:
    """Copy a piece's parts into its slice of `held` (the receiver's full tensor: plain, or
    a tensor-scaled NVFP4 QTensor for a packed piece), in place."""
    if piece.kind != NVFP4:
        held.narrow(piece.dim, piece.start, piece.length).copy_(parts[0])
        return
    codes, scales = _narrow_packed(held.codes, held.block_scales.view(torch.uint8), piece.dim, piece.start,
                                   piece.length)
    codes.copy_(parts[0])
    scales.copy_(parts[1])
    held.global_scale.copy_(parts[2].reshape(()))


def assemble_state_dict(buckets: Iterable[torch.Tensor], shapes: dict[str, tuple[int, ...]],
                        packed: Callable[[str], bool], device="cpu") -> dict:
    """The full state dict that buckets carry (packed weights as QTensors), checked by `Coverage`
    and complete: for receivers that take whole state dicts (it holds the whole model)."""
    coverage, out = Coverage(shapes, packed), {}
    for flat in buckets:
        pieces = read_bucket(flat)
        coverage.add(pieces)
        for piece, parts in pieces:
            if piece.name not in out:
                out[piece.name] = new_value(piece, device)
            write_piece(out[piece.name], piece, [p.to(device) for p in parts])
    coverage.check_complete()
    return out


def new_value(piece: Piece, device) -> torch.Tensor | QTensor:
    """An uninitialised full tensor for `piece`'s weight (a packed QTensor for an nvfp4 piece),
    for its slices to be written into (`write_piece`)."""
    full = piece.full_shape
    if piece.kind != NVFP4:
        return torch.empty(full, dtype=_dtype(piece.kind), device=device)
    *lead, k = full
    return QTensor(torch.empty(*lead, k // 2, dtype=torch.uint8, device=device),
                   torch.empty(*lead, k // 16, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty((), dtype=torch.float32, device=device), Format.NVFP4, torch.Size(full))


def _narrow_packed(codes: torch.Tensor, scales: torch.Tensor, dim: int, start: int, length: int):
    """The codes and block scales of elements [start, start + length) along `dim`."""
    if dim == codes.dim() - 1:
        return codes.narrow(dim, start // 2, length // 2), scales.narrow(dim, start // 16, length // 16)
    return codes.narrow(dim, start, length), scales.narrow(dim, start, length)


def _view(flat: torch.Tensor, start: int, dtype, shape) -> torch.Tensor:
    dt = _dtype(dtype)
    return flat[start:start + math.prod(shape) * dt.itemsize].view(dt).reshape(shape)


def _bytes_tensor(data: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype(name) -> torch.dtype:
    dt = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight bucket: unknown dtype {name!r}")
    return dt
