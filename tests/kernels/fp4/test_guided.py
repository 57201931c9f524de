"""Guided rounding (docs/design.md 4.2-4.3): the trainer reproduces the engine's codes from one bit."""

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.support import spec64
from tests.support.fp4 import (
    BACKENDS,
    assert_same_qtensor,
    e2m1_sweep,
    heavy_tailed,
    triton_device,
)
from trace_kernels.fp4 import (
    E2M1_MAGNITUDES,
    dequantize,
    fake_quantize_guided,
    pack_bits,
    quantize,
    quantize_guided,
    unpack_codes,
)


def guided_on(backend, x, g, s, bits):
    dev = triton_device() if backend == "triton" else "cpu"
    return quantize_guided(x.to(dev), g.to(dev), s.to(dev), bits.to(dev), backend=backend).to("cpu")


def engine_guidance(x_engine):
    """What the engine ships for a site: row g, block scales, packed mantissa bits, and its codes."""
    q = quantize(x_engine, scale="row")
    codes = unpack_codes(q.codes)
    return q.global_scale, q.block_scales, pack_bits(codes & 1), codes


def magnitudes(codes):
    return (codes & 7).long()


def test_neighbouring_magnitudes_alternate_their_mantissa_bit():
    """The property the whole scheme rests on, for every pair, read from ml_dtypes' encoding."""
    enc = np.array(E2M1_MAGNITUDES, dtype=np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert list(enc) == list(range(8))  # code i is magnitude i of the table
    grid = np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    for c in range(7):
        assert grid[c] < grid[c + 1]
        assert (enc[c] & 1) != (enc[c + 1] & 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_values_reproduce_engine_codes_exactly(backend):
    x = heavy_tailed(16, 256, seed=20, dtype=torch.bfloat16)
    g, s, bits, codes = engine_guidance(x)
    q = guided_on(backend, x, g, s, bits)
    assert torch.equal(unpack_codes(q.codes), codes)
    assert torch.equal(q.block_scales.view(torch.uint8), s.view(torch.uint8))


def drift_in_scaled_units(x_engine, s, g, max_units, seed):
    """Trainer values x_e + d * u with |d| < max_units in the engine's scaled units u = s * g."""
    gen = torch.Generator().manual_seed(seed)
    u = (s.float() * g).repeat_interleave(16, -1)
    d = (torch.rand(x_engine.shape, generator=gen) * 2 - 1) * max_units
    return (x_engine.float() + d * u), d


@pytest.mark.parametrize("backend", BACKENDS)
def test_drift_below_half_the_finest_step_is_removed_completely(backend):
    x_e = heavy_tailed(32, 256, seed=21)
    g, s, bits, codes_e = engine_guidance(x_e)
    x_t, _ = drift_in_scaled_units(x_e, s, g, 0.2499, seed=22)
    guided = unpack_codes(guided_on(backend, x_t, g, s, bits).codes)
    # Codes agree exactly, up to the sign of zero (the sign always comes from the trainer).
    assert torch.equal(magnitudes(guided), magnitudes(codes_e))
    nonzero = magnitudes(codes_e) > 0
    assert torch.equal(guided[nonzero], codes_e[nonzero])
    # Without guidance the trainer's own RNE codes flip at a clearly measurable rate.
    plain = unpack_codes(quantize(x_t, scale="row").codes)
    assert (magnitudes(plain) != magnitudes(codes_e)).float().mean() > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_drift_never_moves_more_than_one_step_from_the_trainer_value(backend):
    x_e = heavy_tailed(32, 256, seed=23)
    g, s, bits, _ = engine_guidance(x_e)
    x_t, _ = drift_in_scaled_units(x_e, s, g, 3.0, seed=24)
    guided = magnitudes(unpack_codes(guided_on(backend, x_t, g, s, bits).codes))
    u = (s.double() * g.double()).repeat_interleave(16, -1)
    a = np.minimum(np.abs(x_t.double() / u).numpy(), 6.0)
    lo = (a[..., None] >= spec64.GRID).sum(-1) - 1
    on_grid = spec64.GRID[lo] == a
    ok_between = (guided.numpy() == lo) | (guided.numpy() == lo + 1)
    ok_on_grid = np.abs(guided.numpy() - lo) <= 1
    assert np.all(np.where(on_grid, ok_on_grid, ok_between))
    # And the chosen code always carries the engine's mantissa bit.
    assert torch.equal(torch.from_numpy(guided.numpy() & 1),
                       (unpack_codes(quantize(x_e, scale="row").codes) & 1).long())


def test_triton_guided_matches_reference_on_random_bits_and_ties():
    v = torch.from_numpy(e2m1_sweep()).clamp(-7.0, 7.0)
    v = v[: v.numel() // 16 * 16].reshape(-1, 16)
    m = v.shape[0]
    g = torch.full((m, 1), 1.0 / 448)
    s = torch.full((m, 1), 448.0).to(torch.float8_e4m3fn)
    bits = pack_bits(torch.randint(0, 2, (m, 16), generator=torch.Generator().manual_seed(25)))
    x = v * float(s.float()[0, 0] * g[0, 0])
    qs = [guided_on(b, x, g, s, bits) for b in BACKENDS]
    assert_same_qtensor(*qs)


def test_guided_row_of_zeros_and_saturation():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 100.0, -100.0  # far above the given scale: saturate
    g = torch.ones(1, 1)
    s = torch.ones(1, 1).to(torch.float8_e4m3fn)
    bits = pack_bits(torch.tensor([[0, 1] + [1, 0] * 7], dtype=torch.uint8))
    for backend in BACKENDS:
        codes = unpack_codes(guided_on(backend, x, g, s, bits).codes)[0].tolist()
        assert codes[0] == 6 and codes[1] == 15  # 4 (bit 0), -6 (bit 1)
        assert codes[2] == 1 and codes[3] == 0  # zero with bit 1 -> 0.5; zero with bit 0 -> 0


def test_fake_quantize_guided_values_and_gradient():
    x_e = heavy_tailed(8, 64, seed=26)
    g, s, bits, _ = engine_guidance(x_e)
    x_t = (x_e * 1.3).requires_grad_(True)  # some elements now exceed 7 * s * g
    y = fake_quantize_guided(x_t, g, s, bits)
    q = quantize_guided(x_t.detach(), g, s, bits)
    assert torch.equal(y, dequantize(q))
    y.sum().backward()
    u = (s.double() * g.double()).repeat_interleave(16, -1)
    inside = (x_t.detach().double().abs() / u) < 7.0
    assert int((~inside).sum()) > 0
    assert torch.equal(x_t.grad, inside.float())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda g, s, b: (g.reshape(-1), s, b), "global_scale must be"),
        (lambda g, s, b: (g.double(), s, b), "global_scale must be"),
        (lambda g, s, b: (g, s[:, :-1], b), "block_scales must be"),
        (lambda g, s, b: (g, s.float(), b), "block_scales must be"),
        (lambda g, s, b: (g, s, b[:-1]), "mantissa_bits must be"),
    ],
)
def test_guidance_that_does_not_fit_is_refused(change, match):
    x = heavy_tailed(4, 64, seed=27)
    g, s, bits, _ = engine_guidance(x)
    with pytest.raises(ValueError, match=match):
        quantize_guided(x, *change(g, s, bits))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda g, s: (g * 0, s), "global_scale"),
        (lambda g, s: (g * float("inf"), s), "global_scale"),
        (lambda g, s: (g, torch.full_like(s.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn)), "block_scales"),
        (lambda g, s: (g, (s.view(torch.uint8) | 0x80).view(torch.float8_e4m3fn)), "block_scales"),
        (lambda g, s: (g, torch.zeros_like(s.view(torch.uint8)).view(torch.float8_e4m3fn)), "block_scales"),
    ],
)
def test_scales_the_quantizer_never_produces_are_refused(backend, spoil, match):
    x = heavy_tailed(4, 64, seed=28)
    g, s, bits, _ = engine_guidance(x)
    g, s = spoil(g, s)
    with pytest.raises(ValueError, match=match):
        guided_on(backend, x, g, s, bits)
