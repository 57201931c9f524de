"""TRACE's TE recipe pieces against Transformer Engine 2.20.2's own Python classes, on the CPU
(tests/support/te_cpu.py imports them without TE's extension)."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from megatron_trace.te.nvfp4_storage import (
    from_te_nvfp4,
    swizzle_scales,
    te_scale_shape,
    to_te_nvfp4,
    unswizzle_scales,
)
from megatron_trace.te.roles import Role, Slot, Treatment, parse_role, treatment
from tests.support.te_cpu import te
from trace_kernels.fp4 import dequantize, quantize

if importlib.util.find_spec("transformer_engine") is not None:  # the harness's stand-ins would shadow it
    pytest.skip("TE is installed for real here (a GPU machine): test_te_gpu.py runs against it",
                allow_module_level=True)
TE = te()


def test_the_te_import_leaves_no_te_behind():
    """megatron-core probes `import transformer_engine` (ImportError: no TE); TE's Python without
    its CUDA core raises RuntimeError there instead, so the harness's import must not leak."""
    import sys

    assert TE.version == "2.20.2"
    assert importlib.util.find_spec("transformer_engine") is None
    assert not [m for m in sys.modules if m.startswith("transformer_engine")]


# -- roles ---------------------------------------------------------------------------------------
def te215_roles(num_gemms: int) -> list[str]:
    """The strings TE 2.9-2.15 pass (quantization.py: forward slots cycle input/weight/output,
    backward slots grad_output/grad_input; GroupedLinear has num_gemms of each)."""
    fwd = [("linear_input", "linear_weight", "linear_output")[i % 3] for i in range(3 * num_gemms)]
    bwd = [("linear_grad_output", "linear_grad_input")[i % 2] for i in range(2 * num_gemms)]
    return fwd + bwd


@pytest.mark.parametrize("num_gemms", [1, 4])
def test_te_2_15_string_roles(num_gemms):
    got = [treatment(parse_role(r)) for r in te215_roles(num_gemms)]
    want = ([Treatment.FP4_INPUT, Treatment.FP4_WEIGHT, Treatment.HIGH_PRECISION] * num_gemms
            + [Treatment.HIGH_PRECISION] * (2 * num_gemms))
    assert got == want
    assert parse_role("linear_weight") == Role("", Slot.WEIGHT)
    assert treatment(parse_role("unknown")) is Treatment.HIGH_PRECISION


def test_te_2_16_quantizer_roles():
    """Every (module_type, tensor_type) TE's QuantizerRole carries for Linear, GroupedLinear and
    DotProductAttention, and the None TE passes for unrequested output / grad-input slots."""
    QR = TE.QuantizerRole
    want = {"input": Treatment.FP4_INPUT, "weight": Treatment.FP4_WEIGHT, "output": Treatment.HIGH_PRECISION,
            "grad_output": Treatment.HIGH_PRECISION, "grad_input": Treatment.HIGH_PRECISION}
    for module, (tensor, t) in itertools.product(("linear", "grouped_linear"), want.items()):
        role = parse_role(QR(module_type=module, tensor_type=tensor, name="decoder.layers.3.mlp.experts"))
        assert role == Role(module, Slot(tensor), "decoder.layers.3.mlp.experts")
        assert treatment(role) is t
    for tensor in ("qkv", "s", "o", "dqkv", "dp"):
        assert treatment(parse_role(QR(module_type="dpa", tensor_type=tensor))) is Treatment.HIGH_PRECISION
    assert parse_role(None) is None and treatment(None) is Treatment.HIGH_PRECISION


def test_unknown_roles_are_refused_by_name():
    with pytest.raises(ValueError, match="'linear_bias'"):
        parse_role("linear_bias")
    with pytest.raises(ValueError, match="'layernorm_input'"):
        parse_role("layernorm_input")
    with pytest.raises(ValueError, match="module_type 'mamba'"):
        parse_role(TE.QuantizerRole(module_type="mamba", tensor_type="input"))
    with pytest.raises(ValueError, match="tensor 'bias'"):
        parse_role(TE.QuantizerRole(module_type="linear", tensor_type="bias"))
    with pytest.raises(TypeError, match="expected a str"):
        parse_role(3)


# -- the Blackwell storage layout ----------------------------------------------------------------
def te_dequantize(data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, m: int, k: int,
                  row_scaled: bool) -> torch.Tensor:
    """TE's dequantization of its row-wise NVFP4 storage, float32 [m, k]: TE's reference unpack
    (`cast_from_fp4x2`) times `float(scale) * amax * (1 / (6 * 448))` in float32, the product
    order of dequantize_nvfp4.cuh."""
    e2m1 = TE.cast_from_fp4x2(data, torch.float32)
    s = scale_inv[:m, : k // 16].contiguous().view(torch.float8_e4m3fn).float()
    a = amax.reshape(m, 1) if row_scaled else amax.reshape(1, 1)
    factor_inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0 * 448.0, dtype=torch.float32)
    final = (s * a) * factor_inv
    return e2m1 * final.repeat_interleave(16, dim=1)


@pytest.mark.parametrize("row_scaled,swizzle,shape", [(True, False, (3, 50, 96)), (False, True, (200, 64)),
                                                      (True, True, (128, 32))])
def test_trace_fp4_as_te_nvfp4_storage(row_scaled, swizzle, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.bfloat16) * torch.logspace(-3, 2, shape[-1])
    q = quantize(x, "nvfp4", scale="row" if row_scaled else "tensor")
    f = to_te_nvfp4(q, swizzle=swizzle)
    m, k = math.prod(shape[:-1]), shape[-1]
    # TE's own storage class takes the fields and reports the layout TE's quantizer would allocate
    storage = TE.NVFP4TensorStorage(
        rowwise_data=f.rowwise_data, rowwise_scale_inv=f.rowwise_scale_inv, columnwise_data=None,
        columnwise_scale_inv=None, amax_rowwise=f.amax_rowwise, amax_columnwise=None,
        fp4_dtype=TE.DType.kFloat4E2M1, quantizer=None,
        with_gemm_swizzled_scales=swizzle, row_scaled_nvfp4=row_scaled)
    assert storage._rowwise_data.shape == (m, k // 2) and storage._rowwise_data.dtype == torch.uint8
    assert tuple(storage._rowwise_scale_inv.shape) == te_scale_shape(m, k) == (
        (m + 127) // 128 * 128, (k // 16 + 3) // 4 * 4)
    assert storage._amax_rowwise.shape == ((m,) if row_scaled else (1,))
    # padding is zero; with swizzle, TE's own inverse (the reference quantizer's) gives the compact scales
    compact = (TE.recover_swizzled_scales(True, f.rowwise_scale_inv, m, k, 16) if swizzle
               else f.rowwise_scale_inv[:m, : k // 16])
    assert torch.equal(compact, q.rows().block_scales.view(torch.uint8))
    assert int(f.rowwise_scale_inv.sum()) == int(compact.sum())
    # values: TE's decode of the storage against TRACE's, within TE's product order (2 ulp)
    ours = dequantize(q, torch.float32).reshape(m, k)
    scales = unswizzle_scales(f.rowwise_scale_inv) if swizzle else f.rowwise_scale_inv
    theirs = te_dequantize(f.rowwise_data, scales, f.amax_rowwise, m, k, row_scaled)
    assert torch.equal(theirs == 0, ours == 0)
    ulps = ((theirs - ours).abs() / torch.finfo(torch.float32).eps / ours.abs().clamp_min(1e-38))
    assert float(ulps.max()) <= 2.0
    # and back: codes and scales bit for bit, g within the amax's float32 rounding
    back = from_te_nvfp4(f)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.block_scales.view(torch.uint8),
                                                            q.block_scales.view(torch.uint8))
    torch.testing.assert_close(back.global_scale, q.global_scale, rtol=2 * torch.finfo(torch.float32).eps, atol=0)


def test_swizzle_is_cublas_block_scaling_order():
    """swizzle_scales against TE's C++ index formula (swizzle.cuh) computed element by element."""
    m, c = 256, 8
    s = torch.randint(0, 255, (m, c), dtype=torch.uint8)
    sw = swizzle_scales(s).reshape(-1)
    tiles_x = c // 4
    for iy, ix in itertools.product(range(m), range(c)):
        idx = ((iy // 128) * tiles_x + ix // 4) * 512 + (iy % 128 % 32) * 16 + (iy % 128 // 32) * 4 + ix % 4
        assert sw[idx] == s[iy, ix]
    assert torch.equal(unswizzle_scales(swizzle_scales(s)), s)
    with pytest.raises(ValueError, match="M % 128"):
        swizzle_scales(torch.zeros(100, 4, dtype=torch.uint8))


# -- TRACE's RNE against TE's reference quantizer ------------------------------------------------
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def test_trace_rne_against_te_nvfp4_reference_quantizer():
    """TE's NVFP4QuantizerRef (1x16 tiles, row-scaled, no RHT, no stochastic rounding) on the same
    rows: TRACE's codes and block scales are TE's, except where TE's float32 product order (a
    reciprocal of the global scale, multiplies instead of an exact division) lands on the other
    side of a rounding point. Each difference is checked in float64 to be such a case, and
    TE's block scales underflow to 0 where TRACE's clamp to 2**-9 keeps the block."""
    torch.manual_seed(0)
    m, k = 512, 256
    x = torch.randn(m, k, dtype=torch.bfloat16) * torch.logspace(-2, 2, m).to(torch.bfloat16)[:, None]
    x[7, 32:48] *= 1e-6  # a block far below its row's amax: below E4M3's smallest scale
    ref = TE.NVFP4QuantizerRef(dtype=TE.Fp4Formats.E2M1, rowwise=True, columnwise=False,
                               quant_tile_shape=(1, 16), row_scaled_nvfp4=True, with_rht=False)
    te_codes, te_scales, _, _, te_amax, _ = ref._quantize(x)
    q = quantize(x, "nvfp4", scale="row")
    amax = x.float().abs().amax(-1)
    assert torch.equal(te_amax, amax)
    ours_s, theirs_s = q.block_scales.float(), te_scales[:m, : k // 16].view(torch.float8_e4m3fn).float()

    # block scales: the unrounded value in float64 sits on an E4M3 rounding point (within
    # float32's error of TE's two products), or TE's underflowed to 0 where TRACE clamps
    x64 = x.double().reshape(m, k // 16, 16)
    unrounded = x64.abs().amax(-1) / E2M1_MAX / (amax.double()[:, None] / (E2M1_MAX * E4M3_MAX))
    diff_s = ours_s != theirs_s
    underflow = diff_s & (theirs_s == 0) & (unrounded < 2.0 ** -10)
    assert underflow[7, 2] and int(underflow.sum()) == 1
    for i, j in torch.nonzero(diff_s & ~underflow).tolist():
        lo, hi = sorted((float(ours_s[i, j]), float(theirs_s[i, j])))
        assert abs(unrounded[i, j] - (lo + hi) / 2) <= 1e-6 * unrounded[i, j], (int(i), int(j))
    # BF16 inputs put block-amax / row-amax ratios exactly on E4M3 rounding points now and then
    assert int((diff_s & ~underflow).sum()) <= m * k // 16 // 100

    # codes (element by element), in blocks whose scales agree: where they differ, the exact
    # scaled value sits on an E2M1 rounding point
    def nibbles(packed):
        return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(m, k)

    diff_c = (nibbles(q.codes) != nibbles(te_codes)) & (~diff_s).repeat_interleave(16, dim=1)
    g64 = amax.double() / (E2M1_MAX * E4M3_MAX)
    scaled = (x.double() / (ours_s.double().repeat_interleave(16, dim=1) * g64[:, None])).abs()
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    for i, e in torch.nonzero(diff_c).tolist():
        v = float(scaled[i, e])
        assert float((midpoints - v).abs().min()) <= 1e-6 * v, (i, e, v)
    assert float(diff_c.float().mean()) <= 1e-2


# -- the factory and its quantizers --------------------------------------------------------------
def all_role_forms():
    """(role, treatment) for every form TE passes: 2.9-2.15 strings, 2.16+ roles, None."""
    QR = TE.QuantizerRole
    yield from ((r, treatment(parse_role(r))) for r in te215_roles(2) + ["unknown"])
    for module in ("linear", "grouped_linear"):
        for tensor in ("input", "weight", "output", "grad_output", "grad_input"):
            yield QR(module_type=module, tensor_type=tensor), treatment(parse_role(QR(module_type=module,
                                                                                        tensor_type=tensor)))
    yield QR(module_type="dpa", tensor_type="qkv"), Treatment.HIGH_PRECISION
    yield None, Treatment.HIGH_PRECISION


def test_the_factory_gives_te_quantizers_for_every_role():
    recipe = TE.recipe
    for role, want in all_role_forms():
        q = recipe.trace_fp4_quantizer_factory(role)
        assert isinstance(q, TE.IdentityQuantizer), role  # TE's class: TE's modules accept it
        if want is Treatment.HIGH_PRECISION:
            assert type(q) is TE.IdentityQuantizer, role
        else:
            assert isinstance(q, recipe.TraceNVFP4Quantizer) and q.what is want, role


def on_fp4_grid(v: torch.Tensor, g: torch.Tensor) -> bool:
    """Every 16-element block of the BF16 rows v [M, K] is bf16(e2m1 * s * g) for some E4M3 s
    (float64, every positive E4M3 value tried; BF16's rounding allowed)."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    s = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # every positive finite
    blocks = v.double().abs().reshape(v.shape[0], -1, 1, 16)
    e = blocks / (s.reshape(1, 1, -1, 1) * g.double().reshape(-1, 1, 1, 1))  # [M, B, S, 16]
    near = (e[..., None] - grid).abs() <= 2.0 ** -8 * e[..., None].clamp_min(1e-30)
    return bool(near.any(-1).all(-1).any(-1).all())


@pytest.mark.parametrize("internal", [True, False])
def test_trace_quantizers_hold_fp4_values_in_te_storage(internal):
    """Weights: one global scale over the tensor (g = amax / 2688); inputs: one per row; the result
    TE's high-precision storage of the FP4 grid values in the input's dtype, the same bytes when TE
    re-quantizes a cached weight in place (`update_quantized`)."""
    recipe = TE.recipe
    torch.manual_seed(1)
    w = torch.randn(64, 128, dtype=torch.bfloat16) * torch.logspace(-1, 1, 128).to(torch.bfloat16)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16) * torch.logspace(-2, 2, 10).reshape(2, 5, 1).to(torch.bfloat16)
    wq = recipe.trace_fp4_quantizer_factory("linear_weight")
    xq = recipe.trace_fp4_quantizer_factory(TE.QuantizerRole(module_type="grouped_linear", tensor_type="input"))
    wq.internal = xq.internal = internal
    ws, xs = wq.quantize(w), xq.quantize(x)
    assert isinstance(ws, TE.IdentityTensorStorage) and isinstance(xs, TE.IdentityTensorStorage)
    w_fp4, x_fp4 = ws.dequantize(), xs.dequantize()
    assert w_fp4.dtype == w.dtype and w_fp4.shape == w.shape and x_fp4.shape == x.shape
    g_w = w.float().abs().amax() / 2688
    g_x = x.float().abs().amax(-1).reshape(-1) / 2688
    assert on_fp4_grid(w_fp4.float(), g_w.expand(64)) and on_fp4_grid(x_fp4.reshape(10, 128).float(), g_x)
    assert not on_fp4_grid(w.float(), g_w.expand(64))  # the check can fail
    # the fake quant is TRACE's: dequantize(quantize) of the kernels' reference
    torch.testing.assert_close(w_fp4, dequantize(quantize(w, "nvfp4"), torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(x_fp4, dequantize(quantize(x, "nvfp4", scale="row"), torch.bfloat16), rtol=0, atol=0)
    # a cached weight updated in place
    w2 = w * 1.5
    wq.update_quantized(w2, ws)
    torch.testing.assert_close(ws.dequantize(), dequantize(quantize(w2, "nvfp4"), torch.bfloat16), rtol=0, atol=0)
    with pytest.raises(ValueError, match="weights or inputs"):
        recipe.TraceNVFP4Quantizer(Treatment.HIGH_PRECISION)


def test_a_weight_site_reduces_its_amax_over_the_logical_tensor():
    """With the module's FP4 site active, the weight's global scale is the whole logical tensor's
    (here: its MLA-style peer's amax is larger), not the local shard's."""
    from megatron_trace.megatron.qat import FP4Site
    from megatron_trace.modes import TrainerPrecision

    recipe = TE.recipe
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    peer = torch.randn(16, 64, dtype=torch.bfloat16) * 10
    site = FP4Site(name="qkv", layer=0, precision=TrainerPrecision.FP4_RNE, weight_peers=(peer,))
    q = recipe.trace_fp4_quantizer_factory("linear_weight")
    token = recipe.active_site.set(site)
    try:
        held = q.quantize(w).dequantize()
    finally:
        recipe.active_site.reset(token)
    amax = torch.maximum(w.float().abs().amax(), peer.float().abs().amax())
    torch.testing.assert_close(held, dequantize(quantize(w, "nvfp4", global_amax=amax), torch.bfloat16),
                               rtol=0, atol=0)
    assert not torch.equal(held, q.quantize(w).dequantize())  # without the site: the local amax
