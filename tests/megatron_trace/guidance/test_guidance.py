"""Guidance capture, reconstruction, sparse coding, the batch container and its misuse errors."""

import random

import numpy as np
import pytest
import torch

from megatron_trace.guidance import (
    Coding,
    FlipStats,
    GroupGuidance,
    GuidanceBatch,
    GuidanceFormatError,
    LayerPolicy,
    SampleGuidance,
    calibrate_tau,
    capture,
    capture_sparse,
    capture_sparse_sites,
    code_flips,
    decode_position_streams,
    decode_positions,
    encode_positions,
    guided_inputs,
    sparse_parts,
)
from tests.support.guidance import CODINGS, matmul_two_orders, record_for
from trace_kernels.fp4 import quantize, quantize_guided, unpack_codes


def guided_codes(rec, x_trainer, **expected):
    return unpack_codes(quantize_guided(x_trainer, *guided_inputs(rec, x_trainer, **expected)).codes)


@pytest.mark.parametrize("coding, scale_coding", CODINGS)
def test_identical_values_reproduce_engine_codes(coding, scale_coding):
    x, _ = matmul_two_orders(64, 96, 256, seed=0)
    rec, q = record_for(x, coding, scale_coding=scale_coding)
    assert torch.equal(guided_codes(rec, x), unpack_codes(q.codes))


def test_dense_guidance_removes_every_flip_of_realistic_drift():
    x_e, x_t = matmul_two_orders(128, 96, 512, seed=1)
    rec, q = record_for(x_e)
    engine = unpack_codes(q.codes)
    plain = unpack_codes(quantize(x_t, scale="row").codes)
    assert code_flips(engine, plain).float().mean() > 1e-3  # the drift does flip codes
    assert not code_flips(engine, guided_codes(rec, x_t)).any()


@pytest.mark.parametrize("scale_coding", ["lsb", "near"])
def test_sparse_reproduces_dense_when_drift_is_below_tau(scale_coding):
    x_e, _ = matmul_two_orders(128, 96, 512, seed=2)
    g = torch.Generator().manual_seed(3)
    # Relative drift below half the margins (element tau 2, scale_tau 1 ulp): no unshipped
    # element or scale can cross a boundary.
    x_t = x_e.float() * (1 + (torch.rand(x_e.shape, generator=g) * 2 - 1) * 0.45 * 2.0**-8)
    dense, q = record_for(x_e, Coding.DENSE)
    sparse, _ = record_for(x_e, Coding.SPARSE, scale_coding=scale_coding)
    assert torch.equal(guided_codes(sparse, x_t), guided_codes(dense, x_t))
    assert not code_flips(unpack_codes(q.codes), guided_codes(sparse, x_t)).any()
    assert sparse.nbytes < dense.nbytes / 3


def test_scale_lsbs_recover_engine_scales_under_drift_below_half_an_e4m3_step():
    from trace_kernels.fp4.reference import (
        nvfp4_block_scales,
        nvfp4_block_scales_guided,
    )

    g = torch.Generator().manual_seed(8)
    amax_e = torch.exp(torch.randn(64, 256, generator=g) * 3)
    gs = torch.exp(torch.randn(64, 1, generator=g))
    s_e = nvfp4_block_scales(amax_e, gs)
    # E4M3 steps are >= 6.25% relative: a 3% drift keeps the engine's scale a neighbour.
    amax_t = amax_e * (1 + (torch.rand(amax_e.shape, generator=g) * 2 - 1) * 0.03)
    lsb = s_e.view(torch.uint8) & 1
    assert not torch.equal(nvfp4_block_scales(amax_t, gs).view(torch.uint8), s_e.view(torch.uint8))
    assert torch.equal(nvfp4_block_scales_guided(amax_t, gs, lsb).view(torch.uint8), s_e.view(torch.uint8))


@pytest.mark.parametrize("scale_coding", ["lsb", "near"])
def test_sparse_parts_of_a_whole_step_sliced_per_sequence_give_each_sequences_record(scale_coding):
    # the engine computes sparse_parts once over a step's rows (all its sequences) and slices
    # them per sequence: each slice must give the record of that sequence's rows alone
    x, _ = matmul_two_orders(48, 96, 256, seed=4)
    x[5:9] = 0.0  # all-zero rows: every block scale is "near"
    parts = sparse_parts(x, quantize(x, scale="row"), 2.0, scale_coding)
    header = dict(model_id="m", layer=1, site="qkv", weight_version=3, policy="all")
    for lo, hi in ((0, 7), (7, 30), (30, 48)):
        ref = capture(x[lo:hi], quantize(x[lo:hi], scale="row"), **header, sample_id="s", coding="sparse",
                      tau=2.0, scale_coding=scale_coding)
        got = capture_sparse(*(p[lo:hi] for p in parts), **header, sample_id="s", tau=2.0, scale_coding=scale_coding)
        assert got.header == ref.header and got.payload.keys() == ref.payload.keys()
        for k in ref.payload:
            assert torch.equal(got.payload[k], ref.payload[k]), k
        assert 0 < got.header.n_elems < (hi - lo) * 256  # a real selection, not all or nothing
    # positions and bits against a float64 re-derivation of the selection
    from megatron_trace.guidance.capture import BF16_ULP, MAGNITUDE_FLOOR
    from trace_kernels.fp4.formats import E2M1_ROUNDING_BOUNDARIES
    from trace_kernels.fp4.reference import nvfp4_scaled_values

    q = quantize(x, scale="row")
    v = nvfp4_scaled_values(x, q.global_scale, q.block_scales).double().abs()
    dist = (v[..., None] - torch.tensor(E2M1_ROUNDING_BOUNDARIES, dtype=torch.float64)).abs().amin(-1)
    want = (dist / (BF16_ULP * v.clamp(min=MAGNITUDE_FLOOR)) < 2.0).reshape(-1).nonzero().reshape(-1)
    rec = capture_sparse(*parts, **header, sample_id="s", tau=2.0, scale_coding=scale_coding)
    assert torch.equal(decode_positions(rec.payload["elem_pos"], rec.header.n_elems, x.numel()), want)
    with pytest.raises(GuidanceFormatError, match="marked scales"):
        capture_sparse(*parts[:4], **header, sample_id="s", scale_coding="near")
    with pytest.raises(GuidanceFormatError, match="scale_coding"):
        sparse_parts(x, q, 2.0, "every")


def test_sparse_on_realistic_drift_leaves_few_residual_flips():
    x_e, x_t = matmul_two_orders(256, 96, 1024, seed=4)
    sparse, q = record_for(x_e, Coding.SPARSE)
    flips = code_flips(unpack_codes(q.codes), guided_codes(sparse, x_t)).float().mean().item()
    assert flips < 1e-3
    assert sparse.bits_per_element < 0.5


def test_byte_counts_match_the_formulas():
    x, _ = matmul_two_orders(48, 64, 320, seed=5)
    r, k = x.shape
    dense, _ = record_for(x)
    assert dense.nbytes == 4 * r + r * k // 16 + r * k // 8
    near, _ = record_for(x, Coding.SPARSE, scale_coding="near")
    h, p = near.header, near.payload
    assert near.nbytes == 4 * r + p["scale_pos"].numel() + h.n_scales + p["elem_pos"].numel() + (h.n_elems + 7) // 8
    assert p["elem_pos"].numel() >= h.n_elems and p["scale_pos"].numel() >= h.n_scales
    lsb, _ = record_for(x, Coding.SPARSE, scale_coding="lsb")
    h, p = lsb.header, lsb.payload
    assert lsb.nbytes == 4 * r + (r * k // 16 + 7) // 8 + p["elem_pos"].numel() + (h.n_elems + 7) // 8


@pytest.mark.parametrize("scale_coding", ["lsb", "near"])
def test_sparse_records_of_several_sites_at_once_keep_what_the_format_says(scale_coding):
    # one owner's sites of different widths (48 columns: 3 blocks a row, 63 in all, not whole
    # bytes of scale bits), encoded together: each record as numpy's packbits of its own parts
    sites = {(0, "qkv"): matmul_two_orders(7, 96, 64, seed=1)[0], (0, "fc1"): matmul_two_orders(5, 96, 256, seed=2)[0],
             (3, "fc2"): matmul_two_orders(21, 64, 48, seed=3)[0]}
    sites[(3, "fc2")][2:4] = 0.0  # all-zero rows: no element near a boundary, every scale marked
    parts = {k: sparse_parts(x, quantize(x, scale="row"), 2.0, scale_coding) for k, x in sites.items()}
    recs = capture_sparse_sites(parts, model_id="m", sample_id="s", weight_version=3, policy="all", tau=2.0,
                                scale_coding=scale_coding)
    assert list(recs) == list(sites)
    for key, x in sites.items():
        bits, scales, _, near = (t.numpy().reshape(-1) for t in parts[key][:4])
        pos = np.flatnonzero(np.unpackbits(near, bitorder="little"))
        h, p = recs[key].header, recs[key].payload
        assert (h.layer, h.site, h.rows, h.cols, h.n_elems, h.sample_id) == (*key, *x.shape, pos.size, "s")
        assert 0 < pos.size < x.numel()
        assert decode_positions(p["elem_pos"], h.n_elems, x.numel()).tolist() == pos.tolist()
        want_bits = np.unpackbits(bits, bitorder="little")[pos]
        assert np.array_equal(p["elem_bits"].numpy(), np.packbits(want_bits, bitorder="little"))
        assert torch.equal(p["g"], parts[key][2])
        if scale_coding == "lsb":
            assert h.n_scales == scales.size
            assert np.array_equal(p["scale_bits"].numpy(), np.packbits(scales & 1, bitorder="little"))
        else:
            marked = np.flatnonzero(parts[key][4].numpy().reshape(-1))
            assert h.n_scales == marked.size > 0
            assert decode_positions(p["scale_pos"], h.n_scales, scales.size).tolist() == marked.tolist()
            assert np.array_equal(p["scale_val"].numpy(), scales[marked])
    assert capture_sparse_sites({}, model_id="m", sample_id="s", weight_version=3, policy="all") == {}
    short = dict(parts)
    short[(3, "fc2")] = (*parts[(3, "fc2")][:3], parts[(3, "fc2")][3][:-1], *parts[(3, "fc2")][4:])
    with pytest.raises(GuidanceFormatError, match=r"layer 3 site fc2: parts of shapes .*want bits \[R, K/8\]"):
        capture_sparse_sites(short, model_id="m", sample_id="s", weight_version=3, policy="all",
                             scale_coding=scale_coding)
    with pytest.raises(GuidanceFormatError, match="marked scales .layer 0 site qkv"):
        capture_sparse_sites({k: v[:4] for k, v in parts.items()}, model_id="m", sample_id="s", weight_version=3,
                             policy="all", scale_coding="near")


@pytest.mark.parametrize("positions", [[], [0], [5, 6, 300, 301, 100_000], list(range(0, 5000, 255)),
                                       [254, 255, 510, 1020]])
def test_position_codec_round_trips(positions):
    p = torch.tensor(positions, dtype=torch.int64)
    stream = encode_positions(p)
    assert torch.equal(decode_positions(stream, len(positions), 200_000), p)


def test_position_codec_refuses_bad_streams():
    stream = encode_positions(torch.tensor([3, 700]))
    with pytest.raises(GuidanceFormatError, match="truncated"):
        decode_positions(stream[:-1], 2, 1000)
    with pytest.raises(GuidanceFormatError, match="holds 2 positions, header says 3"):
        decode_positions(stream, 3, 1000)
    with pytest.raises(GuidanceFormatError, match="outside"):
        decode_positions(stream, 2, 500)
    with pytest.raises(GuidanceFormatError, match="strictly increasing"):
        encode_positions(torch.tensor([4, 4]))


def _spec_stream(positions: list[int]) -> torch.Tensor:
    """The gap stream of codec's module docstring, written byte by byte (an independent encoder)."""
    out, prev = [], -1
    for p in positions:
        gap = p - prev - 1
        out += [255] * (gap // 255) + [gap % 255]
        prev = p
    return torch.tensor(out, dtype=torch.uint8)


def test_position_streams_decode_together_as_the_format_says():
    rng = random.Random(0)
    lists = [[], [0], sorted(rng.sample(range(100_000), 40)), [254, 255, 510, 1020], [], list(range(0, 5000, 255)),
             [7]]
    streams = [_spec_stream(p) for p in lists]
    for p, stream in zip(lists, streams, strict=True):
        assert torch.equal(encode_positions(torch.tensor(p, dtype=torch.int64)), stream)
    counts = [len(p) for p in lists]
    limits = [max(p, default=0) + 1 for p in lists]
    assert decode_position_streams(streams, counts, limits).tolist() == [q for p in lists for q in p]
    # one bad stream among many: the error names it
    truncated = streams[:2] + [torch.cat([streams[2], torch.tensor([255], dtype=torch.uint8)])] + streams[3:]
    with pytest.raises(GuidanceFormatError, match="stream 2 of 7: position stream is truncated"):
        decode_position_streams(truncated, counts, limits)
    with pytest.raises(GuidanceFormatError, match="stream 3 of 7: position stream holds 4 positions, header says 5"):
        decode_position_streams(streams, counts[:3] + [5] + counts[4:], limits)
    with pytest.raises(GuidanceFormatError, match="stream 5 of 7: position 4845 is outside the record's 4845"):
        decode_position_streams(streams, counts, limits[:5] + [4845] + limits[6:])


def test_layer_policies():
    assert LayerPolicy.parse("all").select(4) == [0, 1, 2, 3]
    assert LayerPolicy.parse("none").select(4) == []
    assert LayerPolicy.parse("deep:2").select(6) == [4, 5]
    assert LayerPolicy.parse("deep:9").select(3) == [0, 1, 2]
    assert LayerPolicy.parse("layers:5,1").select(6) == [1, 5]
    assert LayerPolicy.parse("0,2").select(3) == [0, 2]
    flip = {0: 0.001, 1: 0.02, 2: 0.005, 3: 0.03}
    cost = {0: 100.0, 1: 100.0, 2: 100.0, 3: 150.0}
    assert LayerPolicy.parse("budget:260").select(4, flip, cost) == [1, 3]
    assert LayerPolicy.parse("budget:0").select(4, flip, cost) == []
    for bad in ("deep:x", "deep:-1", "budget:", "layers:", "most", "1,-2"):
        with pytest.raises(ValueError, match="bad guidance layer policy"):
            LayerPolicy.parse(bad)
    with pytest.raises(ValueError, match="model has 3"):
        LayerPolicy.parse("layers:4").select(3)
    with pytest.raises(ValueError, match="missing for layers"):
        LayerPolicy.parse("budget:100").select(4, {0: 0.1}, cost)


def make_batch(coding=Coding.DENSE, group_size=4, prompt_len=6, seed=10, scale_coding="lsb"):
    """A GRPO group of `group_size` samples with guidance for one site and routed experts."""
    torch.manual_seed(seed)
    batch = GuidanceBatch()
    x_prompt, _ = matmul_two_orders(prompt_len, 64, 128, seed=seed)
    prompt_rec, _ = record_for(x_prompt, coding, sample_id="g0", scale_coding=scale_coding)
    batch.add_group(GroupGuidance(group_id="g0", prompt_len=prompt_len, records={(3, "fc1"): prompt_rec},
                                  routed_experts={3: torch.randint(0, 8, (prompt_len, 2), dtype=torch.int16)}))
    rows = {}
    for i in range(group_size):
        x_resp, _ = matmul_two_orders(5 + i, 64, 128, seed=seed + 1 + i)
        rec, _ = record_for(x_resp, coding, sample_id=f"s{i}", scale_coding=scale_coding)
        batch.add_sample(SampleGuidance(sample_id=f"s{i}", group_id="g0", response_len=5 + i, weight_version=7,
                                        records={(3, "fc1"): rec},
                                        routed_experts={3: torch.randint(0, 8, (5 + i, 2), dtype=torch.int16)}))
        rows[f"s{i}"] = torch.cat([x_prompt, x_resp])
    return batch, rows


@pytest.mark.parametrize("coding, scale_coding", CODINGS)
def test_batch_applies_prompt_and_response_guidance(coding, scale_coding):
    batch, rows = make_batch(coding, scale_coding=scale_coding)
    for sid, x in rows.items():
        g, s, bits = batch.guided_inputs(sid, 3, "fc1", x)
        codes = unpack_codes(quantize_guided(x, g, s, bits).codes)
        assert torch.equal(codes, unpack_codes(quantize(x, scale="row").codes))


def test_prompt_guidance_is_stored_once_per_group():
    one, _ = make_batch(group_size=1)
    four, _ = make_batch(group_size=4)
    prompt_bytes = (sum(r.nbytes for r in four.groups["g0"].records.values())
                    + four.groups["g0"].routed_experts[3].nbytes)
    response_bytes = sum(r.nbytes for s in four.samples.values() for r in s.records.values())
    expert_bytes = sum(t.nbytes for s in four.samples.values() for t in s.routed_experts.values())
    assert four.nbytes == prompt_bytes + response_bytes + expert_bytes
    assert four.num_tokens == 4 * 6 + (5 + 6 + 7 + 8)
    assert four.bytes_per_token() == four.nbytes / four.num_tokens
    # Four samples cost one prompt, not four: less than four times the one-sample batch.
    assert four.nbytes < 4 * one.nbytes


@pytest.mark.parametrize("coding, scale_coding", CODINGS)
def test_batch_round_trips_through_bytes_and_tensors(coding, scale_coding):
    batch, rows = make_batch(coding, scale_coding=scale_coding)
    for restored in (GuidanceBatch.from_bytes(batch.to_bytes()), GuidanceBatch.from_tensors(batch.to_tensors())):
        assert restored.nbytes == batch.nbytes
        for sid, x in rows.items():
            for a, b in zip(restored.guided_inputs(sid, 3, "fc1", x), batch.guided_inputs(sid, 3, "fc1", x),
                            strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert torch.equal(restored.samples[sid].routed_experts[3], batch.samples[sid].routed_experts[3])
        assert torch.equal(restored.groups["g0"].routed_experts[3], batch.groups["g0"].routed_experts[3])


def test_misuse_is_refused_with_a_named_reason():
    batch, rows = make_batch()
    x = rows["s1"]
    rec = batch.samples["s1"].records[(3, "fc1")]
    resp = x[6:]
    with pytest.raises(GuidanceFormatError, match="rows is"):
        guided_inputs(rec, resp[:-1])
    with pytest.raises(GuidanceFormatError, match="cols is"):
        guided_inputs(rec, torch.cat([resp, resp], dim=1))
    with pytest.raises(GuidanceFormatError, match="sample_id is 's1' in the record but 's2'"):
        guided_inputs(rec, resp, sample_id="s2")
    with pytest.raises(GuidanceFormatError, match="weight_version is 7 in the record but 8"):
        batch.guided_inputs("s1", 3, "fc1", x, weight_version=8)
    with pytest.raises(GuidanceFormatError, match="no guidance for layer 2"):
        batch.guided_inputs("s1", 2, "fc1", x)
    with pytest.raises(GuidanceFormatError, match="no guidance for sample"):
        batch.guided_inputs("s9", 3, "fc1", x)
    with pytest.raises(GuidanceFormatError, match="has 12 rows"):
        batch.guided_inputs("s1", 3, "fc1", x[:-1])
    data = batch.to_bytes()
    with pytest.raises(GuidanceFormatError, match="truncated"):
        GuidanceBatch.from_bytes(data[:-3])
    corrupt = bytearray(data)
    corrupt[-5] ^= 0x10
    with pytest.raises(GuidanceFormatError, match="checksum"):
        GuidanceBatch.from_bytes(bytes(corrupt))
    with pytest.raises(GuidanceFormatError, match="bad magic"):
        GuidanceBatch.from_bytes(b"NOTTRACE" + data[8:])
    sizes, header, payload = batch.to_tensors()
    text = bytes(header.numpy().tobytes()).decode()
    for old, new, match in (('"format_version": 1, "crc32"', '"format_version": 9, "crc32"', "version 9"),
                            ('"coding": "dense"', '"coding": "zstd"', "unknown guidance coding")):
        bad = torch.from_numpy(np.frombuffer(text.replace(old, new, 1).encode(), dtype=np.uint8).copy())
        with pytest.raises(GuidanceFormatError, match=match):
            GuidanceBatch.from_tensors([torch.tensor([bad.numel(), payload.numel()]), bad, payload])


def test_flip_stats_and_tau_calibration():
    x_e, x_t = matmul_two_orders(256, 96, 512, seed=30)
    q_e = quantize(x_e, scale="row")
    stats = FlipStats()
    rec, _ = record_for(x_e)
    guided = quantize_guided(x_t, *guided_inputs(rec, x_t))
    stats.add(3, "fc1", q_e, quantize(x_t, scale="row"), guided)
    rates = stats.rates()[(3, "fc1")]
    assert rates["flip_rate"] > 1e-3 and rates["residual_flip_rate"] == 0.0
    assert stats.by_layer()[3] == rates["flip_rate"]
    cal = calibrate_tau(x_e, x_t, q_e, target_escape_rate=1e-4)
    assert 0 < cal["tau"] <= 16 and cal["escape_rate"] <= 1e-4 and cal["kept_rate"] < 0.2
    # The calibrated margin, used for sparse coding, meets the residual target on this drift.
    sparse, _ = record_for(x_e, Coding.SPARSE, tau=cal["tau"], scale_coding="lsb")
    residual = code_flips(unpack_codes(q_e.codes), guided_codes(sparse, x_t)).float().mean().item()
    assert residual <= cal["escape_rate"]  # with scale LSBs only unshipped elements can flip


def test_routed_experts_must_cover_every_token():
    batch, _ = make_batch()
    with pytest.raises(GuidanceFormatError,
                       match=r"routed experts of layer 3 for the sample 's9' response must be integer \[4, top_k\]"):
        batch.add_sample(SampleGuidance(sample_id="s9", group_id="g0", response_len=4, weight_version=7, records={},
                                        routed_experts={3: torch.zeros(5, 2, dtype=torch.int16)}))


def _receive_over_gloo(rank, world, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if rank == 0:
            batch, _ = make_batch(Coding.SPARSE)
            for t in batch.to_tensors():
                dist.send(t, dst=1)
        else:
            sizes = torch.empty(2, dtype=torch.int64)
            dist.recv(sizes, src=0)
            header = torch.empty(int(sizes[0]), dtype=torch.uint8)
            payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
            dist.recv(header, src=0)
            dist.recv(payload, src=0)
            out.put(GuidanceBatch.from_tensors([sizes, header, payload]).to_bytes())
    finally:
        dist.destroy_process_group()


def test_batch_travels_between_processes_over_gloo():
    """The NCCL path's CPU twin: a real two-process gloo group sends and rebuilds a batch."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_receive_over_gloo, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    received = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    batch, rows = make_batch(Coding.SPARSE)
    assert received == batch.to_bytes()
    restored = GuidanceBatch.from_bytes(received)
    g, s, bits = restored.guided_inputs("s2", 3, "fc1", rows["s2"])
    assert torch.equal(unpack_codes(quantize_guided(rows["s2"], g, s, bits).codes),
                       unpack_codes(quantize(rows["s2"], scale="row").codes))


def test_dense_record_from_kept_codes_equals_the_record_from_rows():
    """capture_dense (what the engine's fused quantize kernel keeps) builds the same record as
    capture() from the rows themselves; payloads that do not fit the header are refused."""
    from megatron_trace.guidance import GuidanceFormatError, capture_dense
    from trace_kernels.fp4 import fake_quantize_rows

    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    header = dict(model_id="m", layer=1, site="qkv", sample_id="s", weight_version=3, policy="all")
    want = capture(x, quantize(x, "nvfp4", scale="row"), **header)
    _, (bits, scales, g) = fake_quantize_rows(x, capture=True, backend="torch")
    got = capture_dense(bits, scales, g, **header)
    assert got.header == want.header
    assert all(torch.equal(got.payload[k], want.payload[k]) for k in want.payload)
    with pytest.raises(GuidanceFormatError, match="scales"):
        capture_dense(bits, scales[:, :2], g, **header)
    with pytest.raises(GuidanceFormatError, match=r"\[R, K/8\]"):
        capture_dense(bits.reshape(-1), scales, g, **header)
