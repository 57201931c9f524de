"""TRACE's TE recipe pieces against Transformer Engine 2.20.2's own Python classes, on the CPU
(tests/support/te_cpu.py imports them without TE's extension)."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from megatron_trace.guidance.codec import GuidanceFormatError
from megatron_trace.te.nvfp4_storage import (
    from_te_nvfp4,
    swizzle_scales,
    te_scale_shape,
    to_te_nvfp4,
    unswizzle_scales,
)
from megatron_trace.te.roles import Role, Slot, Treatment, parse_role, treatment
from tests.support.guidance import CODINGS, matmul_two_orders, record_for
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
    # Megatron's TE extension was imported with TE inside; outside, megatron-core still sees none
    import megatron.core.extensions.transformer_engine as extension
    import megatron.core.fp4_utils as fp4_utils

    te_linear = next(c for c in TE.spec.TraceTEColumnParallelLinear.__mro__ if c.__name__ == "TEColumnParallelLinear")
    assert te_linear.__module__ == extension.__name__
    assert not extension.HAVE_TE and not fp4_utils.HAVE_TE


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



def test_each_expert_weight_slot_gets_its_own_weight_under_the_trainers_cache():
    """A grouped linear's weight slots inside `qat.cached_weights()` (the trainer's micro-batches):
    each slot gets a new alias of its weight and must give back that expert's FP4 weight (the
    cache once knew weights by the id of the object passed, which a freed alias passes on:
    tests/megatron_trace/megatron/test_qat.py shows that case)."""
    from megatron_trace.megatron.qat import FP4Site, cached_weights
    from megatron_trace.modes import TrainerPrecision

    recipe = TE.recipe
    site = FP4Site(name="fc1", layer=0, precision=TrainerPrecision.FP4_RNE, all_experts=True, quantizes_input=False)
    ws = [torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16) * (i + 1)) for i in range(4)]
    slots = [recipe.trace_fp4_quantizer_factory(TE.QuantizerRole(module_type="grouped_linear", tensor_type="weight"))
             for _ in ws]
    token = recipe.active_site.set(site)
    try:
        with cached_weights():
            for _ in range(2):  # two micro-batches
                held = [q.quantize(w.detach()).dequantize() for q, w in zip(slots, ws, strict=True)]
                for w, h in zip(ws, held, strict=True):
                    torch.testing.assert_close(h, dequantize(quantize(w.detach(), "nvfp4"), torch.bfloat16),
                                               rtol=0, atol=0)
    finally:
        recipe.active_site.reset(token)


# -- a quantizer at its FP4 site: the local spec's math, TE's grouped GEMM padding dropped --------
def _at_site(site, fn):
    token = TE.recipe.active_site.set(site)
    try:
        return fn()
    finally:
        TE.recipe.active_site.reset(token)


def _expert_input_quantizers(num_gemms):
    """The input slots of a GroupedLinear of `num_gemms` GEMMs, tagged as TRACE's module tags them."""
    qs = []
    for i in range(num_gemms):
        q = TE.recipe.trace_fp4_quantizer_factory(TE.QuantizerRole(module_type="grouped_linear", tensor_type="input"))
        q.gemm = i
        qs.append(q)
    return qs


@pytest.mark.parametrize("coding, scale_coding", [CODINGS[0], CODINGS[1]])
def test_grouped_expert_inputs_follow_the_engines_guidance_past_tes_padding(coding, scale_coding):
    """fc2 of grouped experts: TE quantizes each expert's rows with its own slot, padded to 16
    rows; each slot takes its expert's guidance rows (the MoE layer's dispatched rows) and leaves
    the padding zero. The result equals the local spec's site quantizing all experts at once, and
    follows the engine where round-to-nearest on the trainer's rows would not."""
    from megatron_trace.guidance.rows import RowGuidance
    from megatron_trace.megatron import context
    from megatron_trace.megatron.qat import FP4Site
    from megatron_trace.modes import TrainerPrecision

    counts = [5, 0, 11, 8]
    engine, trainer = matmul_two_orders(sum(counts), 96, 128, seed=4)
    rows = RowGuidance.from_record(record_for(engine, coding, site="fc2", layer=2, scale_coding=scale_coding)[0])
    mb = context.MicroBatchGuidance(num_tokens=sum(counts))
    mb.expert_rows[2] = (rows, counts)
    site = FP4Site(name="fc2", layer=2, precision=TrainerPrecision.FP4_GUIDED, all_experts=True)
    context.activate(mb)
    try:
        want = site.quantize_input(trainer)  # the local spec's TraceGroupedMLP
        got = []
        for q, x in zip(_expert_input_quantizers(len(counts)), trainer.split(counts), strict=True):
            pad = -len(x) % 16
            padded = torch.cat([x, torch.zeros(pad, x.shape[1], dtype=x.dtype)])
            held = _at_site(site, lambda q=q, padded=padded: q.quantize(padded).dequantize())
            assert torch.equal(held[len(x):], torch.zeros_like(held[len(x):]))
            got.append(held[: len(x)])
        with pytest.raises(GuidanceFormatError, match="expert 2: guidance for 11 rows, but TE's GEMM quantizes 8"):
            _at_site(site, lambda: _expert_input_quantizers(4)[2].quantize(trainer[:8]))
    finally:
        context.activate(None)
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=0)
    rne = dequantize(quantize(trainer, "nvfp4", scale="row"), torch.bfloat16)
    assert not torch.equal(torch.cat(got), rne)  # the guidance decided some codes


def test_the_grouped_mlp_quantizes_its_expert_weights_at_once_in_the_trainer():
    """In a `cached_weights` scope TraceTEGroupedMLP fake-quantizes every expert weight of fc1 and
    fc2 in one pass before TE runs; TE's weight slots, expert by expert, then get those values (each
    expert's own global scale). Outside the scope it leaves the weights to TE's slots."""
    from megatron_trace.megatron import qat
    from megatron_trace.megatron.qat import FP4Site, cached_weights
    from megatron_trace.modes import TrainerPrecision

    class Grouped(TE.spec._SiteScoped, torch.nn.Module):  # a grouped linear's parameters, as TE names them
        def __init__(self, n, shape, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.num_gemms = n
            for i in range(n):
                w = torch.randn(*shape, generator=g) * (i + 1)
                self.register_parameter(f"weight{i}", torch.nn.Parameter(w.bfloat16()))

    mlp = TE.spec.TraceTEGroupedMLP.__new__(TE.spec.TraceTEGroupedMLP)
    torch.nn.Module.__init__(mlp)
    mlp.linear_fc1, mlp.linear_fc2, mlp.emulated = Grouped(3, (32, 64), 0), Grouped(3, (64, 16), 1), True
    mlp.fc1_site = FP4Site(name="fc1", layer=0, precision=TrainerPrecision.FP4_RNE, all_experts=True,
                           quantizes_input=False)
    mlp.fc2_site = FP4Site(name="fc2", layer=0, precision=TrainerPrecision.FP4_RNE, all_experts=True)
    mlp._quantize_expert_weights_at_once()  # no scope: nothing to do
    with cached_weights():
        mlp._quantize_expert_weights_at_once()
        assert len(qat._weight_cache) == 2 + 6  # the two stacked passes, and each expert's weight
        for linear in (mlp.linear_fc1, mlp.linear_fc2):
            slot = TE.recipe.trace_fp4_quantizer_factory(
                TE.QuantizerRole(module_type="grouped_linear", tensor_type="weight"))
            for i in range(linear.num_gemms):
                w = getattr(linear, f"weight{i}")
                held = _at_site(linear.fp4_site, lambda w=w: slot.quantize(w.detach()).dequantize())
                torch.testing.assert_close(held, dequantize(quantize(w.detach(), "nvfp4"), torch.bfloat16),
                                           rtol=0, atol=0)
        assert len(qat._weight_cache) == 8  # every slot found its weight


def test_the_grouped_mlp_quantizes_fc2_rows_in_one_pass_past_tes_padding():
    """TraceTEGroupedMLP quantizes fc2's input for all experts at once inside TE's padded layout
    (`_quantize_real_rows`), then TE's per-expert slots pass it through (`input_prequantized`):
    the real rows get the local spec's guided values, the padding stays zero, gradients reach
    every real row."""
    from megatron_trace.guidance.rows import RowGuidance
    from megatron_trace.megatron import context
    from megatron_trace.megatron.qat import FP4Site
    from megatron_trace.modes import TrainerPrecision

    counts, splits = [5, 0, 11, 8], [16, 0, 16, 16]
    engine, trainer = matmul_two_orders(sum(counts), 96, 128, seed=5)
    rows = RowGuidance.from_record(record_for(engine, "dense", site="fc2", layer=1)[0])
    mb = context.MicroBatchGuidance(num_tokens=sum(counts))
    mb.expert_rows[1] = (rows, counts)
    site = FP4Site(name="fc2", layer=1, precision=TrainerPrecision.FP4_GUIDED, all_experts=True)
    parts = [torch.cat([x, torch.zeros(s - c, x.shape[1], dtype=x.dtype)])
             for x, c, s in zip(trainer.split(counts), counts, splits, strict=True)]
    padded = torch.cat(parts).requires_grad_()
    real = torch.cat([torch.arange(s, s + c) for s, c in zip([0, 16, 16, 32], counts, strict=True)])
    context.activate(mb)
    try:
        want = site.quantize_input(trainer)
        got = TE.spec._quantize_real_rows(site, padded, counts, splits)
        slots = _expert_input_quantizers(len(counts))
        token = TE.recipe.input_prequantized.set(True)
        try:
            passed = _at_site(site, lambda: slots[2].quantize(got[16:32].detach()).dequantize())
        finally:
            TE.recipe.input_prequantized.reset(token)
    finally:
        context.activate(None)
    assert torch.equal(got[real], want)
    pad = torch.ones(len(padded), dtype=torch.bool)
    pad[real] = False
    assert torch.equal(got[pad], torch.zeros_like(got[pad]))
    assert torch.equal(passed, got[16:32].detach())  # no second quantization by TE's slot
    got.sum().backward()
    assert torch.equal(padded.grad[real], torch.ones_like(padded.grad[real]))  # nothing clips here
    assert not torch.equal(want, dequantize(quantize(trainer, "nvfp4", scale="row"), torch.bfloat16))


def test_sites_that_do_not_quantize_pass_values_through():
    """The experts' fc1 input was quantized per token before dispatch (the MoE layer's fc1_input
    site): TE's slot must not quantize it again. A BF16 site leaves weights and inputs as they are."""
    from megatron_trace.megatron.qat import FP4Site
    from megatron_trace.modes import TrainerPrecision

    x = torch.randn(32, 64, dtype=torch.bfloat16)
    fc1 = FP4Site(name="fc1", layer=0, precision=TrainerPrecision.FP4_GUIDED, all_experts=True,
                  quantizes_input=False)
    (q,) = _expert_input_quantizers(1)
    assert torch.equal(_at_site(fc1, lambda: q.quantize(x).dequantize()), x)
    bf16 = FP4Site(name="qkv", layer=0, precision=TrainerPrecision.BF16)
    w = TE.recipe.trace_fp4_quantizer_factory("linear_weight")
    assert torch.equal(_at_site(bf16, lambda: w.quantize(x).dequantize()), x)
    assert not torch.equal(w.quantize(x).dequantize(), x)  # no site: quantized


# -- the TE layer spec (structure only: TE's modules need CUDA to be built) ----------------------
def _tiny_config(**kw):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             num_moe_experts=4, moe_ffn_hidden_size=32, ffn_hidden_size=64, moe_layer_freq=[0, 1],
                             moe_shared_expert_intermediate_size=32, qk_layernorm=True, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False, **kw)


def _classes(spec) -> list[str]:
    """Every class and builder a (nested) Megatron spec names, in a fixed order."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return [spec.module.__name__, *_classes(spec.submodules)]
    if isinstance(spec, functools.partial):
        return [spec.func.__name__, *(c for v in spec.keywords.values() for c in _classes(v))]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return [c for f in dataclasses.fields(spec) for c in _classes(getattr(spec, f.name))]
    if isinstance(spec, list):
        return [c for s in spec for c in _classes(s)]
    return [spec.__name__] if isinstance(spec, type) or callable(spec) and hasattr(spec, "__name__") else []


def test_the_te_spec_is_the_local_spec_with_tes_linears():
    """Layer by layer the TE spec names the local spec's modules (TRACE's norms, core attention
    with the K/V sites, MoE layer with replay and guidance dispatch), with TE's linears in place of
    TRACE's local FP4 linears and TE's grouped MLP for the grouped experts; and Megatron accepts the
    TE recipe's settings."""
    from megatron_trace.megatron.spec import LOCAL_LINEARS, trace_layer_spec

    def block(config, grouped, linears):  # a dense layer and a MoE layer
        return [trace_layer_spec(config, moe, grouped, linears) for moe in (False, True)]

    linears = TE.spec.te_linears()
    assert linears.config == {"transformer_impl": "transformer_engine", "fp4": "e2m1", "fp4_recipe": "custom",
                              "fp4_quantizer_factory": TE.spec.FACTORY,
                              "disable_parameter_transpose_cache": True}
    module, _, name = TE.spec.FACTORY.rpartition(".")
    assert getattr(TE.recipe, name) is TE.recipe.trace_fp4_quantizer_factory and module == TE.recipe.__name__
    config = _tiny_config(**linears.config)
    local = _classes(block(_tiny_config(**LOCAL_LINEARS.config), True, LOCAL_LINEARS))
    te_spec = _classes(block(config, True, linears))
    swap = {"FP4ColumnParallelLinear": "TraceTEColumnParallelLinear",
            "FP4RowParallelLinear": "TraceTERowParallelLinear", "TraceGroupedMLP": "TraceTEGroupedMLP"}
    grouped = local.index("TraceGroupedMLP")
    # the local grouped experts name their per-expert linears; TE's grouped MLP its two grouped linears
    assert local[grouped + 1: grouped + 3] == ["FP4ColumnParallelLinear", "FP4RowParallelLinear"]
    want = [swap.get(c, c) for c in local[:grouped + 1]] + ["TraceTEColumnParallelGroupedLinear",
                                                            "TraceTERowParallelGroupedLinear"]
    want += [swap.get(c, c) for c in local[grouped + 3:]]
    assert te_spec == want
    assert "TraceRMSNorm" in te_spec and "FP4CoreAttention" in te_spec and "TraceMoELayer" in te_spec
    sequential = _classes(block(config, False, linears))
    assert "TraceSequentialMLP" in sequential and "TraceTEGroupedMLP" not in sequential
    with pytest.raises(ValueError, match="multi-head latent attention .* local spec only"):
        block(_tiny_config(multi_latent_attention=True, **linears.config), True, linears)


def _micro_batch_lengths(rank, *, num_tokens, token_multiple):
    import dataclasses

    from megatron_trace.megatron.model import pack_sequences
    from megatron_trace.megatron.spec import LOCAL_LINEARS
    from megatron_trace.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(torch.nn.Linear(1, 1), None,
                              linears=dataclasses.replace(LOCAL_LINEARS, token_multiple=token_multiple))
    out = []
    for n in num_tokens:
        ids, _, psp = pack_sequences([torch.arange(n)], pad=trainer.sequence_padding(n))
        out.append((ids.shape[1], int(psp.cu_seqlens_q[-1])))
    return out


def test_te_micro_batches_are_padded_to_16_tokens_per_sequence_parallel_rank():
    """TE's quantized GEMMs refuse a token count that is not a multiple of 8 (the RL loop's first
    GPU run stopped at 659): on the TE spec the trainer pads each micro-batch to 16 tokens per
    tensor-parallel rank (the RL loop's padding, which carries no loss); the local spec to the TP size."""
    from megatron_trace.megatron.spawn import spawn
    from megatron_trace.megatron.spec import LOCAL_LINEARS

    assert TE.spec.te_linears().token_multiple == 16 and LOCAL_LINEARS.token_multiple == 1
    sizes = [659, 640, 1]
    te_lengths = spawn(_micro_batch_lengths, {"tp": 2}, num_tokens=sizes, token_multiple=16)[0]
    local_lengths = spawn(_micro_batch_lengths, {"tp": 2}, num_tokens=sizes, token_multiple=1)[0]
    assert te_lengths == [(672, 672), (640, 640), (32, 32)]
    assert local_lengths == [(660, 660), (640, 640), (2, 2)]


def test_te_modules_tell_the_recipe_their_site():
    """A TE linear's forward runs with its site active; a column-parallel one takes the whole
    micro-batch's rows (TE gathers sequence-parallel inputs before a custom quantizer sees them);
    TE's grouped MLP keeps its expert sites on its two grouped linears."""
    from megatron_trace.megatron.qat import FP4Site, Shard

    seen = []

    class Base:  # the next class in the MRO: records which site is active while it runs
        def forward(self, x):
            seen.append(TE.recipe.active_site.get())
            return x

    class Column(TE.spec._SiteScoped, Base):
        gathers_input = True

    class Row(TE.spec._SiteScoped, Base, torch.nn.Module):
        pass

    site = FP4Site(name="qkv", layer=1, tokens=Shard(1, 2))
    col, row = Column(), Row()
    col.fp4_site, row.fp4_site = site, site
    assert col.fp4_site.tokens is None and col.fp4_site.layer == 1 and row.fp4_site is site
    assert col.forward(3) == 3 and row.forward(4) == 4
    assert seen == [col.fp4_site, site] and TE.recipe.active_site.get() is None
    assert issubclass(TE.spec.TraceTEColumnParallelLinear, TE.spec._SiteScoped)
    assert TE.spec.TraceTEColumnParallelLinear.gathers_input and not TE.spec.TraceTERowParallelLinear.gathers_input
    assert TE.spec.TraceTEColumnParallelGroupedLinear.gathers_input is False  # its input arrives dispatched
    # TE's grouped MLP (built bare: TE's own __init__ needs CUDA) keeps its sites on its linears
    mlp = TE.spec.TraceTEGroupedMLP.__new__(TE.spec.TraceTEGroupedMLP)
    torch.nn.Module.__init__(mlp)
    mlp.linear_fc1, mlp.linear_fc2 = Row(), Row()
    fc1, fc2 = FP4Site(name="fc1", layer=2, all_experts=True), FP4Site(name="fc2", layer=2, all_experts=True)
    mlp.fc1_site, mlp.fc2_site = fc1, fc2
    assert mlp.linear_fc1.fp4_site is fc1 and mlp.linear_fc2.fp4_site is fc2 and mlp.fc2_site is fc2


def test_te_modules_save_no_recipe_state_that_megatron_would_refuse():
    """TE 2.20 pickles a CustomRecipe (its factory callable included) into a module's extra state;
    Megatron's checkpoint code refuses to unpickle it (the RL loop's first GPU run on the TE spec
    failed at its first checkpoint). TRACE's recipe holds no state, so TRACE's TE modules save TE's
    empty "no state" marker, which Megatron's grouped-linear split hands to each GEMM as is."""
    import io
    import pickle

    from megatron.core.safe_globals import SafeUnpickler

    from tests.support.te_cpu import te_importable

    with te_importable():  # pickle finds the recipe's class and the factory by name
        from transformer_engine.common.recipe import CustomRecipe

        from megatron_trace.te.recipe import trace_fp4_quantizer_factory

        recipe = CustomRecipe(qfactory=trace_fp4_quantizer_factory)
        pickled = pickle.dumps({"recipe": recipe})
    with pytest.raises(pickle.UnpicklingError, match="CustomRecipe"):
        SafeUnpickler(io.BytesIO(pickled)).load()
    for cls in (TE.spec.TraceTEColumnParallelLinear, TE.spec.TraceTERowParallelLinear,
                TE.spec.TraceTEColumnParallelGroupedLinear, TE.spec.TraceTERowParallelGroupedLinear):
        module = cls.__new__(cls)  # built bare: TE's own __init__ needs CUDA
        torch.nn.Module.__init__(module)
        module.fp8_meta = {"fp8_checkpoint": True, "recipe": recipe}
        module.fp8, module.fp8_calibration, module.num_gemms = True, False, 3
        state = module.get_extra_state()
        assert state.dtype == torch.uint8 and state.numel() == 0, cls.__name__
        if hasattr(module, "_split_extra_state"):  # Megatron's TE grouped linears
            assert [s.numel() for s in module._split_extra_state(state)] == [0, 0, 0]


def test_te_linears_get_their_input_quantized_by_trace_with_traces_backward():
    """On the emulated path TRACE's plain TE linears fake-quantize their own input rows first (the
    local spec's `quantize_input`: guidance rows of this rank's sequence-parallel shard, TRACE's
    straight-through mask) and tell TE's slots to pass them (`input_prequantized`); a site that
    does not quantize leaves the input to TE as it is."""
    from megatron_trace.guidance.rows import RowGuidance
    from megatron_trace.megatron import context
    from megatron_trace.megatron.qat import FP4Site, Shard
    from megatron_trace.modes import TrainerPrecision

    seen = []

    class Base(torch.nn.Module):  # TE's linear, next in the MRO: records what it was given
        def forward(self, x):
            seen.append((x, TE.recipe.input_prequantized.get(), TE.recipe.active_site.get()))
            return x * 1.0

    class Column(TE.spec._InputQuantizedFirst, Base):
        gathers_input = True

    engine, trainer = matmul_two_orders(24, 96, 64, seed=7)  # 24 tokens; this rank holds 8..15
    rows = RowGuidance.from_record(record_for(engine, "dense", site="qkv", layer=0)[0])
    mb = context.MicroBatchGuidance(num_tokens=24)
    mb.sites[(0, "qkv")] = rows
    site = FP4Site(name="qkv", layer=0, precision=TrainerPrecision.FP4_GUIDED, tokens=Shard(1, 3))
    col = Column()
    col.fp4_site = site
    x = (trainer[8:16] * 8).requires_grad_()  # large enough that guided scales clip some elements
    context.activate(mb)
    try:
        want = site.quantize_input(x)
        y = col(x)
    finally:
        context.activate(None)
    given, prequantized, active = seen[-1]
    assert prequantized and active.tokens is None  # TE's slots see the gathered rows' site
    assert torch.equal(given, want)
    y.sum().backward()
    mask = x.grad != 0
    assert not mask.all() and torch.equal(x.grad, mask.to(x.grad.dtype))  # TRACE's mask, not TE's pass-all
    # a BF16 site: the input as it is, TE's slots not told to pass
    col.fp4_site = FP4Site(name="qkv", layer=0)
    col(trainer[:8])
    assert torch.equal(seen[-1][0], trainer[:8]) and not seen[-1][1]


def test_tes_grouped_expert_weights_get_the_local_specs_names():
    from megatron_trace.megatron.weights import canonical_name

    assert (canonical_name("decoder.layers.3.mlp.experts.linear_fc1.weight12")
            == "decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight")
    assert (canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight0")
            == "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    for name in ("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
                 "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
                 "decoder.layers.0.self_attention.linear_qkv.weight"):
        assert canonical_name(name) == name


# -- the native (Blackwell) storage: the same codes as TE's NVFP4TensorStorage --------------------
def _native(what):
    q = TE.recipe.TraceNVFP4Quantizer(what, native=True)
    q.internal = True  # as TE's modules set their quantizers
    return q


def _decoded(storage, m, k):
    """TE's documented decode of a row-wise NVFP4 storage (te_dequantize above), float32 [m, k]."""
    return te_dequantize(storage._rowwise_data, storage._rowwise_scale_inv, storage._amax_rowwise, m, k,
                         storage._row_scaled_nvfp4)


def test_native_storage_holds_the_codes_of_the_emulated_path():
    """At active sites the native quantizers give TE's NVFP4 storage of TRACE's codes: TE's decode
    of it is the emulated path's values (weights per tensor, inputs per row, a guided expert's
    rows past TE's padding); the fc1 experts' site and BF16 sites stay on the emulated storage
    for both operands; a cached weight is re-quantized in place."""
    from megatron_trace.guidance.rows import RowGuidance
    from megatron_trace.megatron import context
    from megatron_trace.megatron.qat import FP4Site
    from megatron_trace.modes import TrainerPrecision

    torch.manual_seed(3)
    w = torch.randn(64, 96, dtype=torch.bfloat16) * torch.logspace(-1, 1, 96).to(torch.bfloat16)
    x = torch.randn(40, 96, dtype=torch.bfloat16) * torch.logspace(-2, 2, 40)[:, None].to(torch.bfloat16)
    site = FP4Site(name="proj", layer=0, precision=TrainerPrecision.FP4_RNE)
    for what, t, row_scaled in ((Treatment.FP4_WEIGHT, w, False), (Treatment.FP4_INPUT, x, True)):
        native = _at_site(site, lambda what=what, t=t: _native(what).quantize(t))
        emulated = _at_site(site, lambda what=what, t=t: TE.recipe.TraceNVFP4Quantizer(what).quantize(t).dequantize())
        assert isinstance(native, TE.NVFP4TensorStorage) and native._row_scaled_nvfp4 is row_scaled
        torch.testing.assert_close(_decoded(native, *t.shape).bfloat16(), emulated, rtol=2 ** -8, atol=0)
        assert not torch.equal(emulated, t)

    # a guided expert's rows, padded by TE's grouped GEMM
    counts = [5, 11]
    engine, trainer = matmul_two_orders(sum(counts), 96, 128, seed=6)
    rows = RowGuidance.from_record(record_for(engine, site="fc2", layer=1)[0])
    mb = context.MicroBatchGuidance(num_tokens=sum(counts))
    mb.expert_rows[1] = (rows, counts)
    experts = FP4Site(name="fc2", layer=1, precision=TrainerPrecision.FP4_GUIDED, all_experts=True)
    padded = torch.cat([trainer[5:], torch.zeros(5, 128, dtype=trainer.dtype)])  # expert 1: 11 rows + 5
    q = _native(Treatment.FP4_INPUT)
    q.gemm = 1
    context.activate(mb)
    try:
        native = _at_site(experts, lambda: q.quantize(padded))
        want = experts.quantize_input(trainer)[5:]  # the local spec's grouped experts
    finally:
        context.activate(None)
    decoded = _decoded(native, 16, 128)
    torch.testing.assert_close(decoded[:11].bfloat16(), want, rtol=2 ** -8, atol=0)
    assert torch.equal(decoded[11:], torch.zeros(5, 128))

    # sites whose GEMM stays emulated, for both of its operands
    fc1 = FP4Site(name="fc1", layer=0, precision=TrainerPrecision.FP4_GUIDED, all_experts=True, quantizes_input=False)
    bf16 = FP4Site(name="qkv", layer=0, precision=TrainerPrecision.BF16)
    for s in (fc1, bf16):
        for what, t in ((Treatment.FP4_WEIGHT, w), (Treatment.FP4_INPUT, x)):
            held = _at_site(s, lambda what=what, t=t: _native(what).quantize(t))
            assert isinstance(held, TE.IdentityTensorStorage), (s.name, what)

    # a cached weight updated in place
    wq = _native(Treatment.FP4_WEIGHT)
    held = _at_site(site, lambda: wq.quantize(w))
    data = held._rowwise_data
    _at_site(site, lambda: wq.update_quantized(w * 3, held))
    assert held._rowwise_data is data
    fresh = _at_site(site, lambda: wq.quantize(w * 3))
    assert torch.equal(held._rowwise_data, fresh._rowwise_data) and torch.equal(held._amax_rowwise,
                                                                                fresh._amax_rowwise)


def test_the_factory_goes_native_only_with_the_dequantized_backward(monkeypatch):
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    monkeypatch.setenv("TRACE_TE_NATIVE_NVFP4", "0")
    assert not TE.recipe.trace_fp4_quantizer_factory("linear_weight").native
    monkeypatch.setenv("TRACE_TE_NATIVE_NVFP4", "1")
    with pytest.raises(ValueError, match="NVTE_BACKWARD_OVERRIDE=dequantized"):
        TE.recipe.trace_fp4_quantizer_factory("linear_weight")
    assert type(TE.recipe.trace_fp4_quantizer_factory("linear_output")) is TE.IdentityQuantizer
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert TE.recipe.trace_fp4_quantizer_factory("linear_input").native
    monkeypatch.setenv("TRACE_TE_NATIVE_NVFP4", "yes")
    with pytest.raises(ValueError, match="TRACE_TE_NATIVE_NVFP4 must be 0 or 1"):
        TE.recipe.trace_fp4_quantizer_factory("linear_input")
