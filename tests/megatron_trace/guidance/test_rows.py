"""Row-aligned guidance (what FP4 sites consume) and a micro-batch's guidance."""

import numpy as np
import pytest
import torch

from megatron_trace.guidance import (
    GroupGuidance,
    GuidanceBatch,
    GuidanceFormatError,
    SampleGuidance,
)
from megatron_trace.guidance.capture import sparse_parts
from megatron_trace.guidance.rows import RowGuidance
from megatron_trace.megatron.context import MicroBatchGuidance
from tests.support.guidance import CODINGS, matmul_two_orders, record_for
from trace_kernels.fp4 import pack_bits, quantize, quantize_guided, unpack_codes


def test_dense_rows_carry_the_engine_quantization():
    x, _ = matmul_two_orders(24, 96, 128, seed=1)
    rec, q = record_for(x)
    g, scales, bits = RowGuidance.from_record(rec).resolve(x)
    assert torch.equal(g, q.global_scale)
    assert torch.equal(scales.view(torch.uint8), q.block_scales.view(torch.uint8))
    assert torch.equal(bits, pack_bits(unpack_codes(q.codes) & 1))


@pytest.mark.parametrize("coding, scale_coding", CODINGS)
def test_a_column_shard_resolves_like_the_slice_of_the_whole_row(coding, scale_coding):
    """Tensor parallelism: each rank resolves its columns; together they are the full rows'."""
    engine, trainer = matmul_two_orders(32, 96, 256, seed=2)
    rows = RowGuidance.from_record(record_for(engine, coding, scale_coding=scale_coding)[0])
    full = rows.resolve(trainer)
    for lo, hi in ((0, 128), (128, 256), (64, 96)):
        g, scales, bits = rows.select_cols(lo, hi).resolve(trainer[:, lo:hi].contiguous())
        assert torch.equal(g, full[0])
        assert torch.equal(scales.view(torch.uint8), full[1].view(torch.uint8)[:, lo // 16:hi // 16])
        assert torch.equal(bits, full[2][:, lo // 8:hi // 8])
        # and the guided codes of the shard are the shard of the guided codes
        shard = quantize_guided(trainer[:, lo:hi].contiguous(), g, scales, bits)
        whole = quantize_guided(trainer, *full)
        assert torch.equal(unpack_codes(shard.codes), unpack_codes(whole.codes)[:, lo:hi])


@pytest.mark.parametrize("coding, scale_coding", CODINGS)
def test_rows_survive_travel_as_bytes(coding, scale_coding):
    x, _ = matmul_two_orders(16, 64, 64, seed=3)
    rows = RowGuidance.from_record(record_for(x, coding, scale_coding=scale_coding)[0]).with_row_ids()
    picked = rows.select_rows(torch.tensor([3, 3, 0, 15]))  # dispatch repeats tokens
    back = RowGuidance.from_row_bytes(picked.to_row_bytes(), 64, picked.kind)
    assert back.kind == picked.kind and back.row_ids.tolist() == [3, 3, 0, 15]
    for name in ("g", "scales", "bits", "scale_known", "bit_known"):
        a, b = getattr(picked, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    rows_x = x[[3, 3, 0, 15]]
    assert all(torch.equal(u, v) for u, v in zip(back.resolve(rows_x), picked.resolve(rows_x), strict=True))


def test_misuse_names_the_problem():
    x, _ = matmul_two_orders(8, 64, 64, seed=4)
    dense = RowGuidance.from_record(record_for(x)[0])
    sparse = RowGuidance.from_record(record_for(x, "sparse")[0])
    with pytest.raises(GuidanceFormatError, match="mixed codings"):
        RowGuidance.cat([dense, sparse])
    with pytest.raises(GuidanceFormatError, match="block boundaries"):
        dense.select_cols(8, 40)
    with pytest.raises(GuidanceFormatError, match="applied to a tensor of shape"):
        dense.resolve(x[:, :32])
    with pytest.raises(GuidanceFormatError, match="do not hold"):
        RowGuidance.from_row_bytes(dense.to_row_bytes()[:, :-1], 64, dense.kind)


def _batch(version=7):
    """Two groups (prompts 3 and 2 tokens), one sample each (responses 2 and 4 tokens)."""
    batch, xs = GuidanceBatch(), {}
    g = torch.Generator().manual_seed(0)
    for gid, sid, n_prompt, n_resp in (("g0", "s0", 3, 2), ("g1", "s1", 2, 4)):
        xp, xr = torch.randn(n_prompt, 32, generator=g), torch.randn(n_resp, 32, generator=g)
        xs[sid] = torch.cat([xp, xr])
        experts = {0: torch.randint(0, 4, (n_prompt, 2), generator=g)}
        group = GroupGuidance(group_id=gid, prompt_len=n_prompt,
                              records={(0, "qkv"): record_for(xp, sample_id=gid, layer=0, site="qkv",
                                                              version=version)[0]},
                              routed_experts=experts)
        resp = {0: torch.randint(0, 4, (n_resp, 2), generator=g)}
        sample = SampleGuidance(sample_id=sid, group_id=gid, response_len=n_resp, weight_version=version,
                                records={(0, "qkv"): record_for(xr, sample_id=sid, layer=0, site="qkv",
                                                                version=version)[0]},
                                routed_experts=resp)
        batch.add_group(group)
        batch.add_sample(sample)
        xs[sid + "/experts"] = torch.cat([experts[0], resp[0]])
    return batch, xs


def test_micro_batch_concatenates_samples_in_packing_order():
    batch, xs = _batch()
    mb = MicroBatchGuidance.from_batch(batch, ["s1", "s0"])
    assert mb.num_tokens == 11
    x = torch.cat([xs["s1"], xs["s0"]])
    rows = mb.site(0, "qkv")
    assert rows.row_ids.tolist() == list(range(11))
    want = quantize(x, scale="row")
    g, scales, bits = rows.resolve(x)
    assert torch.equal(g, want.global_scale) and torch.equal(bits, pack_bits(unpack_codes(want.codes) & 1))
    assert torch.equal(mb.routed_experts[0], torch.cat([xs["s1/experts"], xs["s0/experts"]]))
    assert mb.for_layers([1]).sites == {} and mb.for_layers([0]).site(0, "qkv") is rows


def test_micro_batch_refuses_what_does_not_fit():
    batch, _ = _batch()
    with pytest.raises(GuidanceFormatError, match="no guidance for sample 'nope'"):
        MicroBatchGuidance.from_batch(batch, ["s0", "nope"])
    with pytest.raises(GuidanceFormatError, match="weight version"):
        MicroBatchGuidance.from_batch(batch, ["s0"], weight_version=8)
    with pytest.raises(GuidanceFormatError, match="routed experts of layer 0 must be"):
        MicroBatchGuidance(5, routed_experts={0: torch.zeros(4, 2, dtype=torch.long)})
    with pytest.raises(GuidanceFormatError, match="unknown FP4 site"):
        MicroBatchGuidance(8, sites={(0, "lm_head"): RowGuidance.from_record(record_for(torch.randn(8, 32))[0])})


@pytest.mark.parametrize("coding, scale_coding", CODINGS)
def test_records_join_as_their_rows_do(coding, scale_coding):
    """from_records (the micro-batch's join: dense records field by field, sparse ones decoded
    together) gives cat of each record's rows, and the rows resolve to the engine's
    quantization of every record."""
    xs = [matmul_two_orders(rows, 64, 64, seed=10 + rows)[0] for rows in (3, 8, 1)]
    made = [record_for(x, coding, scale_coding=scale_coding or "lsb") for x in xs]
    records = [rec for rec, _ in made]
    joined = RowGuidance.from_records(records)
    one_by_one = RowGuidance.cat([RowGuidance.from_record(r) for r in records])
    assert joined.kind == one_by_one.kind and joined.num_rows == 12
    for name in ("g", "scales", "bits", "scale_known", "bit_known"):
        a, b = getattr(joined, name), getattr(one_by_one, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    if coding == "dense":  # every bit shipped: exactly the engine's quantization of each record
        g, scales, bits = joined.resolve(torch.cat(xs))
        assert torch.equal(g, torch.cat([q.global_scale for _, q in made]))
        assert torch.equal(scales.view(torch.uint8), torch.cat([q.block_scales.view(torch.uint8) for _, q in made]))
        assert torch.equal(bits, torch.cat([pack_bits(unpack_codes(q.codes) & 1) for _, q in made]))
    with pytest.raises(GuidanceFormatError, match="widths"):
        RowGuidance.from_records([records[0], record_for(matmul_two_orders(2, 64, 32, seed=3)[0], coding)[0]])


@pytest.mark.parametrize("scale_coding", ["lsb", "near"])
def test_sparse_records_decode_to_the_engine_bits_they_ship(scale_coding):
    """Sparse records of several samples decoded together (the micro-batch's join, packed from the
    kept positions alone) against numpy's packbits of the dense arrays: bit_known is the engine's
    near-boundary mask, the known bits and scales are the engine's."""
    xs = [matmul_two_orders(rows, 64, 128, seed=20 + rows)[0] for rows in (5, 1, 9)]
    made = [record_for(x, "sparse", scale_coding=scale_coding) for x in xs]
    joined = RowGuidance.from_records([rec for rec, _ in made])
    parts = [sparse_parts(x, q, scale_coding=scale_coding) for x, (_, q) in zip(xs, made, strict=True)]
    near = np.concatenate([np.unpackbits(p[3].numpy().reshape(-1), bitorder="little") for p in parts])
    mantissa = np.concatenate([(unpack_codes(q.codes).numpy() & 1).reshape(-1) for _, q in made])
    assert 0.001 < near.mean() < 0.5  # some elements kept, most not
    assert np.array_equal(joined.bit_known.numpy().reshape(-1), np.packbits(near, bitorder="little"))
    assert np.array_equal(joined.bits.numpy().reshape(-1), np.packbits(near & mantissa, bitorder="little"))
    engine_scales = torch.cat([q.block_scales.view(torch.uint8) for _, q in made])
    if scale_coding == "lsb":
        assert joined.scale_known is None and torch.equal(joined.scales & 1, engine_scales & 1)
    else:
        marked = torch.cat([p[4].bool() for p in parts])
        assert torch.equal(joined.scale_known, marked)
        assert torch.equal(joined.scales[marked], engine_scales[marked]) and not joined.scales[~marked].any()
