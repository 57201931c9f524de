"""The one-pass BF16 fake quantization (`fake_quantize_ste`, `fake_quantize_guided_ste`) against
the three-step chain it replaces (quantize, dequantize, `ste_mask`) and a float64 recomputation.

Rows are chosen to be hard: E2M1 ties and the clip bound 7 * s * g hit exactly, zeros of both
signs, blocks whose E4M3 scale is subnormal and rounds down far enough that elements clip under
dynamic scales, rows near the bottom of BF16's range (s * g an FP32 subnormal), global scales too
small for the data (clipping), and an odd number of rows. Under TRITON_INTERPRET=1 on the CPU.
"""

import numpy as np
import pytest
import torch

from tests.support.fp4 import HAS_CUDA, assert_bitwise_equal, heavy_tailed, triton_device
from trace_kernels.fp4 import (
    dequantize,
    e2m1_to_float,
    fake_quantize,
    fake_quantize_guided,
    fake_quantize_guided_ste,
    fake_quantize_ste,
    fake_quantize_ste_flagged,
    pack_bits,
    quantize,
    quantize_guided,
    unpack_codes,
)
from trace_kernels.fp4 import triton_fp4 as T
from trace_kernels.fp4.api import _fake_quantize_guided_ste, ste_mask

DEV = triton_device()
G0 = 2.0**-10  # a power-of-two global scale: with s = 448, u = s * g and its multiples are exact


def _grid_row(k: int) -> torch.Tensor:
    """Quarter steps of u = 448 * G0 from -7.75 u to 7.75 u, each block also holding 8 u (so its
    scale is 448 under g = G0): every E2M1 tie, every guided threshold, the clip bound 7 u."""
    steps = torch.arange(-31, 32, dtype=torch.float64)
    free = steps.repeat(k // 16 * 15 // steps.numel() + 1)[: k // 16 * 15].reshape(-1, 15)
    blocks = torch.cat([torch.full((k // 16, 1), 32.0), free], 1)
    return (blocks.reshape(-1) * 0.25 * 448 * G0).float()


def _subnormal_scale_row(k: int) -> torch.Tensor:
    """Row max 1, the other blocks' amax c * 6 g 2**-9 with c in (7/6, 1.5) or (7/3, 2.5): their
    E4M3 scale rounds down to 2**-9 or 2 * 2**-9, so the largest elements clip (|x| >= 7 s g)."""
    g = 1.0 / 2688
    c_max = [1.45, 2.45, 1.3, 2.4]
    blocks = [torch.linspace(-c_max[b % 4], c_max[b % 4], 16) * 6 * g * 2.0**-9 for b in range(k // 16)]
    row = torch.cat(blocks)
    row[0] = 1.0
    return row


def hard_rows(k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(x bf16 [7, k], a given row amax float32 [7, 1] that clips some rows)."""
    heavy = heavy_tailed(2, k, seed=41)
    zeros = torch.zeros(k)
    zeros[1::2] = -0.0
    tiny = heavy_tailed(1, k, seed=42)[0] * 2e-38  # s * g is an FP32 subnormal
    rows = [heavy[0], zeros, _grid_row(k), _subnormal_scale_row(k), tiny, heavy[1] * 1e3, -heavy[0] * 3]
    x = torch.stack(rows).bfloat16()
    amax = x.float().abs().amax(-1, keepdim=True)
    given = amax * torch.tensor([[0.125], [0.0], [0.0], [1.0], [1.0], [2.0], [0.3]])
    given[2] = 2688 * G0
    return x, given


def _values64(q) -> torch.Tensor:
    """bf16(fl32(e2m1 * s * g)) from float64 (the product is exact there): dequantize's spec."""
    r = q.rows()
    m, k = r.shape
    v = e2m1_to_float(unpack_codes(r.codes)).double().reshape(m, k // 16, 16)
    u = r.block_scales.double() * r.global_scale.double().reshape(-1, 1) if r.global_scale.dim() else \
        r.block_scales.double() * float(r.global_scale)
    return (v * u.unsqueeze(-1)).reshape(m, k).float().bfloat16()


def _mask64(x: torch.Tensor, q) -> torch.Tensor:
    """|x| < 7 u, u = fl32(s * g), the bound fl32(7 u): each FP32 step an exact float64 product rounded once."""
    r = q.rows()
    g = r.global_scale.double().reshape(-1, 1) if r.global_scale.dim() else r.global_scale.double()
    u = (r.block_scales.double() * g).float().double()
    bound = (7.0 * u).float().double()
    m, k = r.shape
    return (x.double().reshape(m, k // 16, 16).abs() < bound.unsqueeze(-1)).reshape(m, k)


def _three_step(x, backend, **kw):
    q = quantize(x, backend=backend, check_finite=False, **kw)
    return q, dequantize(q, torch.bfloat16, backend=backend), ste_mask(x, q)


def _on(t):
    return None if t is None else t.to(DEV)


MODES = {  # name -> quantize keyword arguments (given amaxes filled in by the test)
    "row, amax in the kernel": dict(scale="row"),
    "row, given amax": dict(scale="row", global_amax="given"),
    "tensor, amax computed": dict(scale="tensor"),
    "tensor, given amax": dict(scale="tensor", global_amax=torch.tensor(2688 * G0)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [128, 16400])  # 16400: rows longer than a program (flat tiles, g per block)
def test_fused_values_and_mask_equal_the_three_step_chain_and_float64(mode, k):
    x, given = hard_rows(k)
    if k > 128:
        x = x[[0, 2, 3]]  # three long rows keep the interpreter quick
        given = given[[0, 2, 3]]
    kw = dict(MODES[mode])
    if isinstance(kw.get("global_amax"), str):
        kw["global_amax"] = given
    out, mask = fake_quantize_ste(x.to(DEV), **{**kw, "global_amax": _on(kw.get("global_amax"))},
                                  backend="triton", check_finite=False)
    out, mask = out.cpu(), mask.cpu()
    q, want, want_mask = _three_step(x, "torch", **kw)
    assert out.dtype == torch.bfloat16 and mask.dtype == torch.bool and mask.shape == x.shape
    assert_bitwise_equal(out, want)
    assert torch.equal(mask, want_mask)
    assert_bitwise_equal(out, _values64(q))
    assert torch.equal(mask, _mask64(x, q))
    _, via_triton, _ = _three_step(x.to(DEV), "triton", **{**kw, "global_amax": _on(kw.get("global_amax"))})
    assert_bitwise_equal(out, via_triton.cpu())
    if "given" in mode:
        assert 0 < int((~mask).sum()) < mask.numel()  # the given scales clip some elements
    if k == 128 and "kernel" in mode:
        assert not bool(mask[3, :16].all() and mask[3, 16:].all())  # subnormal block scales clip
        assert bool(mask[[0, 1, 2, 4, 5, 6]].all())  # normal scales never do


def test_fused_kernel_stores_the_scales_and_global_scales_quantize_does():
    x, given = hard_rows()
    for row_amax in (None, given.reshape(-1)):
        out, _, scales, g, *_ = T.fake_quantize_bf16_triton(x.to(DEV), row_amax=_on(row_amax))
        q = quantize(x, scale="row", global_amax=None if row_amax is None else given, backend="torch")
        assert torch.equal(scales.cpu(), q.block_scales.view(torch.uint8))
        assert torch.equal(g.cpu(), q.global_scale.reshape(-1))


def _guidance(x: torch.Tensor, seed: int):
    """The engine's scales for x's rows (row 2, the grid row: g = G0, s = 448) and random bits."""
    q = quantize(x, scale="row")
    g, s = q.global_scale.clone(), q.block_scales.clone()
    g[2] = G0
    s[2] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    bits = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return g, s, pack_bits(bits)


@pytest.mark.parametrize("k", [128, 16400])
def test_fused_guided_values_and_mask_equal_the_three_step_chain_and_float64(k):
    x_e, _ = hard_rows(k)
    if k > 128:
        x_e = x_e[[0, 2, 3]]
    g, s, bits = _guidance(x_e, seed=43)
    drift = torch.ones(x_e.shape[0], 1) * 1.3
    drift[2] = 1.0  # the grid row keeps its exact ties
    x = (x_e.float() * drift).bfloat16()  # beyond 7 s g in places
    out, mask = fake_quantize_guided_ste(x.to(DEV), g.to(DEV), s.to(DEV), bits.to(DEV), backend="triton",
                                         check_finite=False)
    out, mask = out.cpu(), mask.cpu()
    q = quantize_guided(x, g, s, bits, backend="torch")
    assert_bitwise_equal(out, dequantize(q, torch.bfloat16, backend="torch"))
    assert torch.equal(mask, ste_mask(x, q))
    assert_bitwise_equal(out, _values64(q))
    assert torch.equal(mask, _mask64(x, q))
    assert 0 < int((~mask).sum()) < mask.numel()
    assert not bool(mask[2 if k == 128 else 1].all())  # the grid row: 7 u and beyond clip


@pytest.mark.parametrize("mode", ["row, amax in the kernel", "row, given amax", "tensor, amax computed", "guided"])
def test_the_kernels_all_inside_answer_is_the_reference_masks_all(mode):
    """Whether the mask is all true comes from the kernel's per-program flags (no second pass over
    the mask, and none written where with_mask=False): the same answer as the three-step chain's
    mask.all(), for each hard row alone and for groups of rows (several programs), both answers
    occurring."""
    x, given = hard_rows()
    guidance = _guidance(x, seed=44)
    drifted = (x.float() * torch.tensor([1.0, 1, 1, 1, 1, 1.3, 1.3]).reshape(-1, 1)).bfloat16()  # 5, 6 clip
    answers = set()
    for rows in [[i] for i in range(len(x))] + [[0, 1, 2, 4, 5, 6], list(range(len(x)))]:
        xs = x[rows]
        if mode == "guided":
            xs = drifted[rows]
            g, s, bits = (t[rows] for t in guidance)
            _, mask, all_inside = _fake_quantize_guided_ste(
                xs.to(DEV), g.to(DEV), s.to(DEV), bits.to(DEV), backend="triton", check_finite=False)
            q = quantize_guided(xs, g, s, bits, backend="torch")
        else:
            kw = dict(MODES[mode])
            if kw.get("global_amax") == "given":
                kw["global_amax"] = given[rows]
            on_dev = {**kw, "global_amax": _on(kw.get("global_amax"))}
            _, mask, all_inside = fake_quantize_ste_flagged(xs.to(DEV), **on_dev, backend="triton", check_finite=False)
            _, unwritten, answer = fake_quantize_ste_flagged(xs.to(DEV), **on_dev, backend="triton",
                                                             check_finite=False, with_mask=False)
            assert unwritten is None and bool(answer) == bool(all_inside)  # the same answer, the mask not written
            q = quantize(xs, backend="torch", check_finite=False, **kw)
        want = ste_mask(xs, q)
        assert torch.equal(mask.cpu(), want)
        assert all_inside.shape == () and bool(all_inside) == bool(want.all()), rows
        answers.add(bool(all_inside))
    assert answers == {True, False}


def _near_bf16_ties(s: float, n: int) -> torch.Tensor:
    """n global scales g (float32) whose value e * s * g (e = 1.5, 3, 6) rounds to another BF16
    when computed as e * fl32(s * g) instead of dequantize's fl32(e * s) * g."""
    rng = np.random.default_rng(47)
    g = (rng.uniform(1, 2, 1 << 21) * 2.0 ** rng.integers(-20, 20, 1 << 21)).astype(np.float32)
    spec = torch.from_numpy((3.0 * float(s) * g.astype(np.float64)).astype(np.float32)).bfloat16()
    other = torch.from_numpy(np.float32(3.0) * (np.float32(s) * g)).bfloat16()
    return torch.from_numpy(g[(spec.view(torch.int16) != other.view(torch.int16)).numpy()][:n])


def test_values_near_bf16_ties_take_dequantizes_order_of_products():
    """(e2m1 * s) * g, not e2m1 * (s * g): the two differ by an FP32 ulp, and near a BF16 tie the
    BF16 values differ too. Guided rows pin the codes (x ~ e * s * g, mantissa bits 1)."""
    s = 1.5
    g = _near_bf16_ties(s, 8)
    assert g.numel() == 8
    e = torch.tensor([1.5, 3.0, 6.0, -1.5, -3.0, -6.0, 0.0, 1.0]).repeat(2)
    x = (e.double() * s * g.double().reshape(-1, 1)).bfloat16()
    scales = torch.full((8, 1), s).to(torch.float8_e4m3fn)
    bits = pack_bits(torch.ones(8, 16, dtype=torch.uint8))
    out, mask = fake_quantize_guided_ste(x.to(DEV), g.reshape(-1, 1).to(DEV), scales.to(DEV), bits.to(DEV),
                                         backend="triton")
    q = quantize_guided(x, g.reshape(-1, 1), scales, bits, backend="torch")
    assert torch.equal(unpack_codes(q.codes)[:, :3], torch.tensor([[3, 5, 7]] * 8, dtype=torch.uint8))
    assert_bitwise_equal(out.cpu(), _values64(q))
    assert_bitwise_equal(out.cpu(), dequantize(q, torch.bfloat16, backend="torch"))
    assert bool(mask.all())


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", ["row", "row, given amax", "tensor, given amax", "guided"])
def test_non_finite_rows_give_what_the_three_step_chain_gives(kind, mode):
    """Non-finite input has no specified codes; the fused kernel still gives the chain's bytes."""
    x, given = hard_rows()
    x[0, 5] = x[5, 77] = float(kind)
    x = x.to(DEV)
    if mode == "guided":
        g, s, bits = (t.to(DEV) for t in _guidance(x.cpu().float().nan_to_num(0.0, 0.0, 0.0).bfloat16(), seed=44))
        out, mask = fake_quantize_guided_ste(x, g, s, bits, backend="triton", check_finite=False)
        q = quantize_guided(x, g, s, bits, backend="triton", check_finite=False)
        want, want_mask = dequantize(q, torch.bfloat16, backend="triton"), ste_mask(x, q)
    else:
        kw = {"row": dict(scale="row"), "row, given amax": dict(scale="row", global_amax=given.to(DEV)),
              "tensor, given amax": dict(global_amax=torch.tensor(2688 * G0, device=DEV))}[mode]
        out, mask = fake_quantize_ste(x, backend="triton", check_finite=False, **kw)
        _, want, want_mask = _three_step(x, "triton", **kw)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert torch.equal(mask, want_mask)
    with pytest.raises(ValueError, match="NaN or Inf"):
        if mode == "guided":
            fake_quantize_guided_ste(x, g, s, bits, backend="triton")
        else:
            fake_quantize_ste(x, backend="triton", **kw)


def _grad(x):
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(45)).bfloat16().to(x.device)


@pytest.mark.parametrize("kw", [dict(scale="row"), dict(scale="row", global_amax="given"),
                                dict(global_amax=torch.tensor(2688 * G0))], ids=["row", "row-given", "tensor"])
def test_fake_quantize_gradient_is_grad_times_the_reference_mask(kw):
    x, given = hard_rows()
    if isinstance(kw.get("global_amax"), str):
        kw = {**kw, "global_amax": given}
    q, want, want_mask = _three_step(x, "torch", **kw)
    xd = x.to(DEV).requires_grad_(True)
    y = fake_quantize(xd, backend="triton", check_finite=False, **{**kw, "global_amax": _on(kw.get("global_amax"))})
    grad = _grad(xd)
    y.backward(grad)
    assert_bitwise_equal(y.detach().cpu(), want)
    assert_bitwise_equal(xd.grad.cpu(), grad.cpu() * want_mask)  # -0.0 where a negative gradient is cut
    assert int((~want_mask).sum()) > 0


def test_fake_quantize_guided_gradient_is_grad_times_the_reference_mask():
    x_e, _ = hard_rows()
    g, s, bits = _guidance(x_e, seed=46)
    x = (x_e.float() * 1.3).bfloat16()
    q = quantize_guided(x, g, s, bits, backend="torch")
    xd = x.to(DEV).requires_grad_(True)
    y = fake_quantize_guided(xd, g.to(DEV), s.to(DEV), bits.to(DEV), backend="triton", check_finite=False)
    grad = _grad(xd)
    y.backward(grad)
    assert_bitwise_equal(y.detach().cpu(), dequantize(q, torch.bfloat16, backend="torch"))
    assert_bitwise_equal(xd.grad.cpu(), grad.cpu() * ste_mask(x, q))


def test_without_gradient_no_mask_is_made_and_values_are_the_same():
    x, _ = hard_rows()
    x = x.to(DEV)
    out, mask = fake_quantize_ste(x, scale="row", backend="triton", with_mask=False)
    assert mask is None
    with torch.no_grad():
        y = fake_quantize(x.clone().requires_grad_(True), scale="row", backend="triton")
    assert_bitwise_equal(out, y)
    assert_bitwise_equal(out, fake_quantize_ste(x, scale="row", backend="triton")[0])


def test_rows_the_kernel_does_not_take_fall_back_to_the_three_steps():
    """A BF16 view that is not 16-byte aligned (or float32 input) takes the three-step chain.
    Without the tiny row: the interpreter loads BF16 subnormals wrongly into `_quantize_kernel`
    (the BF16 kernel reads bits, so the fused path is not affected)."""
    x, given = hard_rows()
    x, given = x[[0, 1, 2, 3, 5, 6]], given[[0, 1, 2, 3, 5, 6]]
    flat = torch.empty(x.numel() + 1, dtype=torch.bfloat16)
    flat[1:] = x.reshape(-1)
    x_odd = flat[1:].view(x.shape).to(DEV) if not HAS_CUDA else flat.to(DEV)[1:].view(x.shape)
    assert not T.fusable(x_odd)
    for xi in (x_odd, x.to(DEV)):
        out, mask = fake_quantize_ste(xi, scale="row", global_amax=given.to(DEV), backend="triton")
        _, want, want_mask = _three_step(x, "torch", scale="row", global_amax=given)
        assert_bitwise_equal(out.cpu(), want)
        assert torch.equal(mask.cpu(), want_mask)
    xf = x.float().to(DEV)
    out, mask = fake_quantize_ste(xf, scale="row", backend="triton")
    q = quantize(x.float(), scale="row", backend="torch")
    assert torch.equal(out.cpu(), dequantize(q, backend="torch")) and torch.equal(mask.cpu(), ste_mask(x.float(), q))


def test_grid_row_hits_every_tie_exactly():
    """The tie row really holds the E2M1 midpoints and the clip bound as exact multiples of u."""
    u = 448 * G0
    row = _grid_row(128).bfloat16().double() / u
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0):
        assert bool((row == t).any()) and bool((row == -t).any())
    assert np.isclose(float(row.abs().max()), 8.0)
