"""quantize / dequantize / fake_quantize against float64, torchao, and across backends.

Each case runs the torch reference and the Triton kernel (under TRITON_INTERPRET=1 on the
CPU) and requires them to agree bit for bit, and checks the reference against an
independent float64 re-derivation of the spec (spec64.py).
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import spec64
from tests.support.fp4 import (
    BACKENDS,
    assert_bitwise_equal,
    assert_same_qtensor,
    dequantize_on,
    e2m1_sweep,
    heavy_tailed,
    quantize_on,
)
from trace_kernels.fp4 import dequantize, fake_quantize, quantize, unpack_codes


def assert_matches_spec64(x, q, scale):
    xf = x.reshape(-1, x.shape[-1]).float().numpy()
    if q.fmt.value == "mxfp4":
        codes, scale_bytes = spec64.mxfp4(xf)
        assert np.array_equal(q.block_scales.reshape(scale_bytes.shape).numpy(), scale_bytes)
    else:
        codes, scales, g = spec64.nvfp4(xf, row_scale=scale == "row")
        assert np.array_equal(q.global_scale.reshape(np.shape(g)).numpy(), g.astype(np.float32))
        assert np.array_equal(q.block_scales.float().reshape(scales.shape).numpy(), scales)
    assert np.array_equal(unpack_codes(q.codes).reshape(codes.shape).numpy(), codes)


CASES = [("nvfp4", "tensor"), ("nvfp4", "row"), ("mxfp4", None)]


@pytest.mark.parametrize("fmt, scale", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_and_triton_match_float64_spec(fmt, scale, dtype):
    x = heavy_tailed(6, 160, seed=1, dtype=dtype).reshape(2, 3, 160)
    qs = [quantize_on(b, x, fmt, scale) for b in BACKENDS]
    assert_same_qtensor(*qs)
    assert_matches_spec64(x, qs[0], scale)
    assert qs[0].codes.shape == (2, 3, 80)
    if scale == "row":
        assert qs[0].global_scale.shape == (2, 3, 1)
    elif fmt == "nvfp4":
        assert qs[0].global_scale.shape == ()
    d = [dequantize_on(b, qs[0], dtype) for b in BACKENDS]
    assert_bitwise_equal(d[0], d[1])
    assert d[0].dtype == dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_scale_is_independent_of_batching(backend):
    x = heavy_tailed(8, 64, seed=2)
    whole = quantize_on(backend, x, scale="row")
    for i in range(0, 8, 3):
        part = quantize_on(backend, x[i:i + 3], scale="row")
        assert torch.equal(part.codes, whole.codes[i:i + 3])
        assert torch.equal(part.global_scale, whole.global_scale[i:i + 3])


def test_mxfp4_matches_torchao_floor_rule():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = heavy_tailed(16, 256, seed=3)
    scale_e8m0, data_lp = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    q = quantize(x, "mxfp4")
    assert torch.equal(q.block_scales, scale_e8m0.view(torch.uint8).reshape(q.block_scales.shape))
    assert torch.equal(q.codes, data_lp.view(torch.uint8).reshape(q.codes.shape))


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp4_scale_rules_match_float64(rule):
    # Block amaxes spanning the whole E8M0 range, mantissas on both sides of 1.5, zero blocks.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 64, generator=g) * torch.exp2(torch.randint(-140, 126, (40, 1), generator=g).float())
    x[3] = 0.0
    x[5, :32] = 0.0
    for backend in BACKENDS:
        q = quantize_on(backend, x, "mxfp4", mx_scale_rule=rule)
        codes, scale_bytes = spec64.mxfp4(x.numpy(), rule)
        assert np.array_equal(q.block_scales.numpy(), scale_bytes)
        assert np.array_equal(unpack_codes(q.codes).numpy(), codes)
    if rule == "ceil":  # the ceiling rule never saturates
        d = dequantize(q)
        assert bool((d.abs() <= x.abs().reshape(40, 2, 32).amax(-1).repeat_interleave(32, -1) * 1.5 + 1e-45).all())


def test_nvfp4_matches_torchao_where_conventions_coincide():
    """torchao scales by (1/g)/s and multiplies; we divide by s*g (docs/design.md section 2).

    With a power-of-two global scale the block scales coincide exactly; element codes may
    differ only where x*(1/u) and x/u fall on different sides of a rounding boundary, which
    the float64 re-derivation must confirm for every differing element.
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    x = heavy_tailed(64, 512, seed=5)
    g = 2.0 ** np.floor(np.log2(float(x.abs().max()) / 2688.0))
    q = quantize(x, global_amax=torch.tensor(g * 2688.0))
    assert float(q.global_scale) == g
    ao_scales, ao_packed = nvfp4_quantize(x, per_tensor_scale=torch.tensor(g, dtype=torch.float32))
    ours = q.block_scales.float()
    big = ours >= 2.0**-6  # torchao clamps block scales at 2**-6, we at 2**-9
    assert torch.equal(ours[big], ao_scales.float().reshape(ours.shape)[big])
    ours_c, ao_c = unpack_codes(q.codes), unpack_codes(ao_packed.view(torch.uint8))
    mask = big.repeat_interleave(16, -1)
    differ = (ours_c != ao_c) & mask
    assert differ.float().mean() < 1e-3
    if differ.any():
        codes, _, _ = spec64.nvfp4(x.numpy(), row_scale=False, global_amax=g * 2688.0)
        assert np.array_equal(ours_c.numpy(), codes)
        # Each differing element sits within a couple of float32 ulps of an E2M1 tie.
        u = (ours.repeat_interleave(16, -1) * g)[differ].double()
        v = x[differ].double() / u
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
        dist = (v.abs().unsqueeze(-1) - ties).abs().min(-1).values
        assert bool((dist <= 4 * torch.finfo(torch.float32).eps * v.abs()).all())


def test_all_zero_rows_and_blocks():
    x = heavy_tailed(4, 64, seed=6)
    x[1] = 0.0
    x[2, 16:32] = 0.0
    for backend in BACKENDS:
        q = quantize_on(backend, x, scale="row")
        assert float(q.global_scale[1]) == 1.0
        assert bool((q.block_scales.float()[1] == 1.0).all()) and float(q.block_scales.float()[2, 1]) == 1.0
        assert bool((q.codes[1] == 0).all()) and bool((q.codes[2, 8:16] == 0).all())
        assert torch.equal(dequantize(q)[1], torch.zeros(64))


def test_negative_values_rounding_to_zero_keep_their_sign():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, -1e-3, -0.0
    for backend in BACKENDS:
        codes = unpack_codes(quantize_on(backend, x).codes)
        assert codes[0, 1] == 8 and codes[0, 2] == 8
        assert bool(torch.signbit(dequantize_on(backend, quantize_on(backend, x))[0, 1]))


def test_exact_ties_round_to_even():
    # g = 1/448 (amax 6) so that s = 1/6 * 448... choose the block amax so the scale is exact.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1:8] = ties
    x[0, 8:15] = -ties
    # amax 6 -> g = 6/2688 = 1/448 exactly; s = 6 / (6 g) = 448; u = 448 * g = 1.0.
    for backend in BACKENDS:
        q = quantize_on(backend, x)
        assert float(q.block_scales.float()[0, 0]) == 448.0
        codes = unpack_codes(q.codes)[0].tolist()
        assert codes[1:8] == [0, 2, 2, 4, 4, 6, 6]
        assert codes[8:15] == [8, 10, 10, 12, 12, 14, 14]


def test_huge_and_tiny_magnitudes():
    x = heavy_tailed(4, 64, seed=7)
    x[0] *= 1e35
    x[1] *= 1e-30
    x[2, :16] *= 2.0**-20  # blocks far below the row max: subnormal E4M3 block scales
    x3 = torch.cat([x, torch.full((1, 64), 3e38)])
    for scale in ("row", "tensor"):
        qs = [quantize_on(b, x3, scale=scale) for b in BACKENDS]
        assert_same_qtensor(*qs)
        assert_matches_spec64(x3, qs[0], scale)
        assert bool(torch.isfinite(dequantize(qs[0])).all())
    q = quantize(x, scale="tensor")
    assert float(q.block_scales.float().min()) < 2.0**-6  # the subnormal range was exercised


@st.composite
def fp4_inputs(draw):
    fmt, scale = draw(st.sampled_from(CASES))
    bs = 16 if fmt == "nvfp4" else 32
    m = draw(st.integers(1, 5))
    k = bs * draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    # Per-block magnitudes over many binades, some blocks and rows zeroed, some exact ties.
    blocks = torch.exp2(torch.randint(-40, 40, (m, k // bs, 1), generator=gen).float())
    x = (x.reshape(m, k // bs, bs) * blocks).reshape(m, k)
    if draw(st.booleans()):
        x[draw(st.integers(0, m - 1))] = 0.0
    if draw(st.booleans()):
        j = draw(st.integers(0, k // bs - 1))
        x[:, j * bs:(j + 1) * bs] = 0.0
    if draw(st.booleans()):  # a block of exact E2M1 ties under a power-of-two amax
        x[0, :bs] = (torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * (bs // 8))
                     * 2.0 ** draw(st.integers(-20, 20)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x.to(dtype), fmt, scale


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp4_inputs())
def test_property_backends_agree_with_float64_spec(case):
    x, fmt, scale = case
    qs = [quantize_on(b, x, fmt, scale) for b in BACKENDS]
    assert_same_qtensor(*qs)
    assert_matches_spec64(x, qs[0], scale)
    d = dequantize(qs[0])
    assert_bitwise_equal(d, dequantize_on("triton", qs[0]))
    assert bool(torch.isfinite(d).all())


@pytest.mark.parametrize("fmt, scale", CASES)
def test_stochastic_rounding_is_seeded_and_matches_across_backends(fmt, scale):
    x = heavy_tailed(6, 128, seed=8)
    a = quantize_on("torch", x, fmt, scale, rounding="stochastic", seed=123)
    b = quantize_on("triton", x, fmt, scale, rounding="stochastic", seed=123)
    assert_same_qtensor(a, b)
    c = quantize(x, fmt, scale, rounding="stochastic", seed=124)
    assert not torch.equal(a.codes, c.codes)
    # Every stochastic code is one of the two grid neighbours of the scaled value (float64).
    bs = a.block_size
    if fmt == "mxfp4":
        u = np.ldexp(1.0, a.block_scales.numpy().astype(np.int64) - 127)
    else:
        u = a.block_scales.double().numpy() * a.global_scale.double().numpy()
    v = np.minimum(np.abs(x.double().numpy() / np.repeat(u, bs, axis=-1)), 6.0)
    lo = (v[..., None] >= spec64.GRID).sum(-1) - 1
    mag = (unpack_codes(a.codes) & 7).numpy()
    on_grid = spec64.GRID[lo] == v
    assert np.all((mag == lo) | ((mag == lo + 1) & ~on_grid))
    assert np.mean(mag == lo + 1) > 0.1  # it does round up, not only down


def test_stochastic_rounding_is_unbiased():
    # Fix the scales (amax 6 in each block -> u = 1 with g = 1/448), then many copies of
    # values between grid points: the mean of the rounded values must converge to x.
    vals = torch.tensor([0.1, 0.3, 0.6, 1.2, 1.7, 2.2, 2.9, 3.3, 4.7, 5.5, -0.4, -2.6, -5.9, 0.0, 1.0])
    x = torch.empty(4096, 16)
    x[:, 0] = 6.0
    x[:, 1:] = vals
    n = x.shape[0]
    for backend in BACKENDS:
        q = quantize_on(backend, x, rounding="stochastic", seed=99, global_amax=torch.tensor(6.0))
        d = dequantize_on(backend, q)
        mean = d[:, 1:].mean(0)
        # Bernoulli between neighbours one step (<= 2) apart: sd of the mean <= 1/sqrt(n).
        assert torch.allclose(mean, vals, atol=4.0 / n**0.5)
        assert torch.equal(d[:, -1], torch.ones(n))  # grid points are never moved


def test_fake_quantize_forward_and_straight_through_gradient():
    x = heavy_tailed(4, 64, seed=9).requires_grad_(True)
    y = fake_quantize(x, scale="row")
    assert torch.equal(y, dequantize(quantize(x.detach(), scale="row")))
    y.backward(torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape))
    # Dynamic scales do not clip here (the block max lands at most ~6.4 in scaled units while the
    # block scale is an E4M3 normal; see test_clip_mask.py for the subnormal exception).
    assert torch.equal(x.grad, torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape))


@pytest.mark.parametrize("scale", ["row", "tensor"])
def test_fake_quantize_of_no_rows(scale):
    """An expert that got no tokens (TE's grouped linear quantizes its empty split) is no error."""
    x = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fake_quantize(x, scale=scale, global_amax=torch.tensor(1.0) if scale == "tensor" else None)
    y.sum().backward()
    assert y.shape == x.shape and y.dtype == x.dtype and x.grad.shape == x.shape


def test_fake_quantize_gradient_is_zero_where_values_saturate():
    x = heavy_tailed(4, 64, seed=10)
    amax = x.abs().max() / 4  # a global scale too small for the tensor: large elements clip
    x.requires_grad_(True)
    y = fake_quantize(x, global_amax=amax)
    y.sum().backward()
    q = quantize(x.detach(), global_amax=amax)
    # Independent float64 bound: clipped where |x| / (s g) >= 7, halfway from 6 to 8.
    u = (q.block_scales.double() * float(q.global_scale)).repeat_interleave(16, -1)
    inside = x.detach().double().abs() / u < 7.0
    assert 0 < int((~inside).sum()) < x.numel()
    assert torch.equal(x.grad, inside.float())
    assert torch.allclose(y[~inside].double().abs(), 6.0 * u[~inside], rtol=1e-6)


def test_fake_quantize_bf16_keeps_dtype_and_gradient_dtype():
    x = heavy_tailed(2, 32, seed=11, dtype=torch.bfloat16).requires_grad_(True)
    y = fake_quantize(x, scale="row")
    y.float().pow(2).sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (torch.randn(2, 24), {}, "multiple of its block size 16"),
        (torch.randn(2, 48), {"fmt": "mxfp4"}, "multiple of its block size 32"),
        (torch.randn(2, 0), {}, "positive multiple"),
        (torch.tensor(1.0), {}, "positive multiple"),
        (torch.randint(0, 5, (2, 16)), {}, "unsupported dtype"),
        (torch.randn(2, 16, dtype=torch.float64), {}, "unsupported dtype"),
        (torch.randn(2, 16), {"fmt": "int4"}, "unsupported FP4 format"),
        (torch.randn(2, 32), {"fmt": "mxfp4", "scale": "row"}, "mxfp4 has no global scale"),
        (torch.randn(2, 16), {"scale": "column"}, "unknown scale mode"),
        (torch.randn(2, 16), {"rounding": "up"}, "unknown rounding"),
        (torch.randn(2, 16), {"seed": 3}, "seed is only used"),
        (torch.randn(2, 16), {"scale": "row", "global_amax": torch.tensor(1.0)}, "global_amax must have shape"),
        (torch.randn(2, 16), {"global_amax": torch.tensor(float("nan"))}, "finite non-negative"),
    ],
)
def test_bad_input_is_a_clear_value_error(backend, x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_on(backend, x, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt, scale", CASES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(backend, fmt, scale, bad):
    x = torch.randn(3, 64)
    x[1, 17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_on(backend, x, fmt, scale)


@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_rows_longer_than_one_program_take_the_torch_amax_path(rounding):
    from trace_kernels.fp4 import triton_fp4

    k = triton_fp4.MAX_ROW_ELEMENTS + 32
    x = heavy_tailed(2, k, seed=12)
    seed = 5 if rounding == "stochastic" else None
    qs = [quantize_on(b, x, "nvfp4", "row", rounding, seed) for b in BACKENDS]
    assert_same_qtensor(*qs)
    if rounding == "rne":
        assert_matches_spec64(x, qs[0], "row")


def test_triton_element_rounding_matches_reference_on_a_dense_sweep():
    """Every scaled value of a dense sweep (ties and their neighbours included), through both backends."""
    v = torch.from_numpy(e2m1_sweep()).clamp(-6.0, 6.0)
    v = v[: v.numel() // 15 * 15].reshape(-1, 15)
    x = torch.cat([torch.full((v.shape[0], 1), 6.0), v], dim=1)  # block amax 6 -> scale u = 1
    qs = [quantize_on(b, x, global_amax=torch.tensor(6.0)) for b in BACKENDS]
    assert_same_qtensor(*qs)
    assert float(qs[0].block_scales.float().min()) == 448.0
    assert np.array_equal(unpack_codes(qs[0].codes)[:, 1:].numpy(), spec64.e2m1_rne(v.numpy()))


@pytest.mark.parametrize("fmt, scale", CASES)
def test_float32_subnormal_inputs(fmt, scale):
    """Rows whose amax (and so g, or an MX scale of 2**-127) lies in float32's subnormal range."""
    x = heavy_tailed(4, 64, seed=13)
    x[0] *= 2.0**-128
    x[1] *= 2.0**-140
    x[2, :32] *= 2.0**-135
    qs = [quantize_on(b, x, fmt, scale) for b in BACKENDS]
    assert_same_qtensor(*qs)
    assert_matches_spec64(x, qs[0], scale)
    assert_bitwise_equal(dequantize_on("torch", qs[0]), dequantize_on("triton", qs[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_shards_with_the_whole_rows_amax_quantize_as_the_whole_rows(backend):
    """Row-parallel inputs: each tensor-parallel rank holds some columns of every row and
    quantizes them with the all-reduced row amax; the bytes are those of the unsharded rows."""
    x = heavy_tailed(24, 256, seed=11, dtype=torch.bfloat16)
    whole = quantize(x, scale="row")
    row_amax = x.float().abs().amax(-1, keepdim=True)
    for lo, hi in ((0, 128), (128, 256), (32, 80)):
        part = quantize_on(backend, x[:, lo:hi].contiguous(), scale="row", global_amax=row_amax)
        assert torch.equal(part.global_scale, whole.global_scale)
        assert torch.equal(unpack_codes(part.codes), unpack_codes(whole.codes)[:, lo:hi])
        assert torch.equal(part.block_scales.view(torch.uint8),
                           whole.block_scales.view(torch.uint8)[:, lo // 16:hi // 16])
    with pytest.raises(ValueError, match=r"global_amax must have shape \(24, 1\)"):
        quantize(x, scale="row", global_amax=row_amax[:12])
