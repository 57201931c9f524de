"""Weight buckets (megatron_trace.weight_buckets): the flat format, cutting to a size, FP4 slices
quantized on the way with their whole tensor's amax, and the receiver's coverage checks."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.guidance import expert_id_dtype
from megatron_trace.weight_buckets import (
    QUANTIZE_WORK_BYTES,
    Buckets,
    Coverage,
    Piece,
    Source,
    assemble_state_dict,
    read_bucket,
    state_dict_buckets,
)
from trace_kernels.fp4 import QTensor, quantize

SHAPES = {"a.linear_proj.weight": (32, 64), "b.norm.weight": (48,), "c.linear_qkv.weight": (40, 32)}


def packed(name: str) -> bool:
    return name.endswith(("linear_proj.weight", "linear_qkv.weight"))


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g).bfloat16() if len(s) == 2 else torch.randn(*s, generator=g)
            for k, s in SHAPES.items()}


def sliced_sources(sd: dict) -> list[Source]:
    """Two slices of each packed weight (proj along columns, qkv along rows), quantized on the
    way with the whole tensor's amax, as two tensor-parallel ranks send them; the rest whole."""
    out = []
    for name, t in sd.items():
        if not packed(name):
            out.append(Source(Piece.whole(name, t), t))
            continue
        dim = 1 if "proj" in name else 0
        half = t.shape[dim] // 2
        for i in range(2):
            part = t.narrow(dim, i * half, half)
            out.append(Source(Piece(name, "nvfp4", dim, i * half, tuple(part.shape), tuple(t.shape)), part,
                              t.abs().amax().float()))
    return out


def same(a, b) -> bool:
    if isinstance(a, QTensor):
        return (torch.equal(a.codes, b.codes) and torch.equal(a.block_scales.view(torch.uint8),
                                                              b.block_scales.view(torch.uint8))
                and torch.equal(a.global_scale, b.global_scale))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("max_bytes", [96, 700, 1 << 20])
def test_slices_quantized_on_the_way_reassemble_to_the_whole_tensors_codes(max_bytes):
    sd = weights()
    buckets = Buckets(sliced_sources(sd), max_bytes)
    flats = list(buckets)
    assert len(flats) == len(buckets) and buckets.nbytes == sum(f.numel() for f in flats)
    for flat in flats:  # the parts of every bucket fit (one 16-block column of proj is 288 bytes)
        pieces = read_bucket(flat)
        assert sum(p.nbytes for p, _ in pieces) <= max(max_bytes, 288 + 48)
    got = assemble_state_dict(flats, SHAPES, packed)
    for name, t in sd.items():
        assert same(got[name], quantize(t, "nvfp4") if packed(name) else t), name


def test_fp4_chunks_are_cut_to_what_the_quantizer_can_hold_in_a_bucket():
    piece = Piece("w", "nvfp4", 0, 0, (4096, 64), (4096, 64))
    chunks = piece.split(1 << 16, quantizes=True)
    assert all(c.shape[0] * 64 * QUANTIZE_WORK_BYTES <= 1 << 16 for c in chunks)
    assert sum(c.length for c in chunks) == 4096 and [c.start for c in chunks] == [i * 32 for i in range(128)]
    # already packed: cut by bytes alone, (64 KiB - 3 parts' alignment) // 36 bytes a row
    assert [c.length for c in piece.split(1 << 16)] == [1819, 1819, 458]


def test_a_state_dict_with_packed_weights_round_trips():
    sd = {k: quantize(t, "nvfp4") if packed(k) else t for k, t in weights(1).items()}
    got = assemble_state_dict(state_dict_buckets(sd, 200), SHAPES, packed)
    assert all(same(got[k], sd[k]) for k in sd)


def _coverage_error(pieces, match):
    cov = Coverage(SHAPES, packed)
    with pytest.raises(ValueError, match=match):
        for piece, parts in pieces:
            cov.add([(piece, parts)])
        cov.check_complete()


G = [torch.zeros(16, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), torch.ones(1)]


@pytest.mark.parametrize("pieces, match", [
    ([(Piece("a.linear_prj.weight", "nvfp4", 0, 0, (32, 64), (32, 64)), G)], "unknown tensor 'a.linear_prj.weight'"),
    ([(Piece("b.norm.weight", "float32", 0, 0, (40,), (40,)), [None])], r"b.norm.weight has shape \(40,\)"),
    ([(Piece("b.norm.weight", "float32", 0, 40, (16,), (48,)), [None])], "b.norm.weight: a slice from 40"),
    ([(Piece("b.norm.weight", "float32", 0, 0, (24,), (48,)), [None])] * 2, r"b.norm.weight \[0:24\] of dim 0 arrived "
                                                                             "twice"),
    ([(Piece("a.linear_proj.weight", "nvfp4", 1, 8, (32, 16), (32, 64)), G)], "does not fall on 16-element blocks"),
    ([(Piece("a.linear_proj.weight", "bfloat16", 0, 0, (16, 64), (32, 64)), [None])], "arrived as a bfloat16 slice"),
    ([(Piece("b.norm.weight", "nvfp4", 0, 0, (48,), (48,)), G)], "b.norm.weight arrived as FP4"),
    ([(Piece("c.linear_qkv.weight", "nvfp4", 0, 0, (20, 32), (40, 32)), G),
      (Piece("c.linear_qkv.weight", "nvfp4", 0, 20, (20, 32), (40, 32)), G[:2] + [torch.full((1,), 2.0)])],
     "c.linear_qkv.weight: a slice's global scale"),
    ([(Piece("c.linear_qkv.weight", "nvfp4", 0, 0, (20, 32), (40, 32)), G),
      (Piece("c.linear_qkv.weight", "nvfp4", 1, 0, (40, 16), (40, 32)), G)], "sliced along dims 0 and 1"),
    ([(Piece("c.linear_qkv.weight", "nvfp4", 0, 0, (20, 32), (40, 32)), G)],
     r"incomplete: 3 weights missing or partial, e.g. \['a.linear_proj.weight', 'b.norm.weight', 'c.linear_qkv"),
])
def test_a_piece_that_does_not_fit_is_refused_by_name(pieces, match):
    _coverage_error(pieces, match)


def test_a_malformed_bucket_is_refused():
    flat = next(iter(state_dict_buckets(weights(), 1 << 20)))
    with pytest.raises(ValueError, match="truncated inside its"):
        read_bucket(flat[:20])
    with pytest.raises(ValueError, match="its header .* says"):
        read_bucket(flat[:-16])
    with pytest.raises(ValueError, match="flat uint8"):
        read_bucket(flat.view(torch.int16))


def test_routed_expert_ids_travel_in_the_smallest_integer_type():
    assert [expert_id_dtype(n) for n in (8, 256, 257, 2**15, 2**15 + 1)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]


def test_weights_holding_nan_or_inf_are_refused_before_anything_is_sent():
    sd = weights(2)
    sd["c.linear_qkv.weight"][3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"1 weights hold NaN or Inf, e.g. \['c.linear_qkv.weight'\]"):
        state_dict_buckets(sd, 1 << 20, fp4=True)
