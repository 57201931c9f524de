"""Element and scale codecs, packing and the counter RNG against independent references."""

import ml_dtypes
import numpy as np
import pytest
import torch
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4

from tests.support import spec64
from tests.support.fp4 import e2m1_sweep
from trace_kernels.fp4 import (
    e2m1_to_float,
    e4m3_to_float,
    e8m0_to_float,
    float_to_e2m1_rne,
    pack_bits,
    pack_codes,
    rng,
    unpack_bits,
    unpack_codes,
)


def test_every_e2m1_code_matches_ml_dtypes():
    codes = torch.arange(16, dtype=torch.uint8)
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = e2m1_to_float(codes).numpy()
    assert np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # code 8 is -0.0


def test_e2m1_rne_matches_ml_dtypes_including_ties_and_saturation():
    v = e2m1_sweep()
    got = float_to_e2m1_rne(torch.from_numpy(v)).numpy()
    want = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    # ml_dtypes drops the sign of values that round to zero; the spec keeps it (code 8).
    want = np.where((want == 0) & np.signbit(v), 8, want)
    assert np.array_equal(got, want)


def test_e2m1_rne_matches_torchao():
    v = torch.from_numpy(e2m1_sweep()).clamp(-6, 6)
    assert torch.equal(float_to_e2m1_rne(v), f32_to_f4_unpacked(v))


def test_e2m1_rne_matches_float64_grid_search():
    v = e2m1_sweep()
    assert np.array_equal(float_to_e2m1_rne(torch.from_numpy(v)).numpy(), spec64.e2m1_rne(v))


def test_e4m3_and_e8m0_decoding_matches_ml_dtypes():
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    want = finite.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(e4m3_to_float(torch.from_numpy(finite)).numpy(), want)
    e8 = np.arange(256, dtype=np.uint8)
    want = e8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = e8m0_to_float(torch.from_numpy(e8)).numpy()
    assert np.array_equal(got[:255], want[:255]) and np.isnan(got[255]) and np.isnan(want[255])


def test_pack_codes_matches_torchao_and_round_trips():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_codes(codes)
    assert torch.equal(packed, pack_uint4(codes))
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))  # even element in the low nibble
    assert torch.equal(unpack_codes(packed), codes)


def test_pack_bits_matches_numpy_little_endian():
    bits = torch.randint(0, 2, (5, 96), dtype=torch.uint8)
    want = np.packbits(bits.numpy(), axis=-1, bitorder="little")
    assert np.array_equal(pack_bits(bits).numpy(), want)
    assert torch.equal(unpack_bits(pack_bits(bits)), bits)


@pytest.mark.parametrize(
    "fn, arg, match",
    [
        (pack_codes, torch.zeros(3, dtype=torch.uint8), "even last dimension"),
        (pack_codes, torch.full((4,), 16, dtype=torch.uint8), "above 15"),
        (pack_codes, torch.zeros(4, dtype=torch.int32), "uint8"),
        (pack_bits, torch.zeros(12, dtype=torch.uint8), "divisible by 8"),
        (pack_bits, torch.full((8,), 2, dtype=torch.uint8), "0 or 1"),
        (e2m1_to_float, torch.full((2,), 16, dtype=torch.uint8), "0..15"),
    ],
)
def test_packing_rejects_bad_input(fn, arg, match):
    with pytest.raises(ValueError, match=match):
        fn(arg)


def test_counter_hash_matches_python_integers():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    got = rng.hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [rng.hash32_int(x) for x in xs]


def test_uniforms_are_uniform_and_seed_dependent():
    idx = torch.arange(200_000, dtype=torch.int64)
    u = rng.uniform_from_counter(idx, rng.seed_key(7))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert torch.allclose(hist, torch.full((10,), 0.1), atol=0.005)
    assert not torch.equal(u, rng.uniform_from_counter(idx, rng.seed_key(8)))


def test_mantissa_bits_is_pack_bits_of_the_codes_lowest_bit():
    from trace_kernels.fp4 import mantissa_bits, pack_bits, pack_codes

    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert torch.equal(mantissa_bits(pack_codes(codes)), pack_bits(codes & 1))
    with pytest.raises(ValueError, match="mantissa_bits"):
        mantissa_bits(pack_codes(codes)[:, :6])


def test_rounding_of_row_scaled_rows_is_what_a_dense_record_keeps():
    from trace_kernels.fp4 import quantize

    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = quantize(x, "nvfp4", scale="row")
    bits, scales, g = q.rounding()
    lsb = (unpack_codes(q.codes.reshape(6, 32)) & 1).numpy()
    assert np.array_equal(bits.numpy(), np.packbits(lsb, axis=1, bitorder="little"))
    assert torch.equal(scales, q.block_scales.reshape(6, 4).view(torch.uint8))
    assert g.shape == (6,) and torch.equal(g, q.global_scale.reshape(6))
    with pytest.raises(ValueError, match="row-scaled NVFP4, got nvfp4 tensor-scaled"):
        quantize(x, "nvfp4").rounding()
