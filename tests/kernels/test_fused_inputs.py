"""FP4 site inputs computed and fake-quantized in one kernel (trace_kernels.fused_inputs), against
torch's own F.rms_norm and F.silu(gate) * up followed by the torch reference quantizer: under
TRITON_INTERPRET=1 on the CPU (CI) and on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.fp4 import assert_bitwise_equal, heavy_tailed, triton_device
from trace_kernels.fp4 import fake_quantize_rows
from trace_kernels.fused_inputs import (
    add_rms_norm_fake_quantize_rows,
    rms_norm_fake_quantize_rows,
    silu_mul,
    silu_mul_backward,
    silu_mul_fake_quantize_rows,
)


def _assert_torch_rounding(got, want, exact):
    """Bit for bit where torch computes on the same device with the same libdevice exp (the GPU);
    else (the interpreter: numpy's exp, another sum order) at most one BF16 ulp apart and almost
    all equal."""
    got, want = got.cpu(), want.cpu()
    if exact:
        assert_bitwise_equal(got, want)
        return
    g, w = got.float(), want.float()
    ulp = torch.where(w == 0, torch.full_like(w, 2.0**-133), w.abs() * 2.0**-7)
    assert ((g - w).abs() <= ulp).all()
    assert g.numel() == 0 or (g == w).float().mean() >= 0.999


def _assert_quantized_from(xq, kept, rows):
    """xq and the capture are the torch reference's fake quantization of `rows`, bit for bit."""
    want, want_kept = fake_quantize_rows(rows.cpu(), capture=True, backend="torch")
    assert_bitwise_equal(xq.cpu(), want)
    for got, ref in zip(kept, want_kept, strict=True):
        assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("rows, k", [(37, 2048), (5, 256), (3, 96), (1, 16), (0, 64)])
def test_rms_norm_fake_quantize_is_norm_then_fake_quantize(rows, k):
    x = (heavy_tailed(rows, k, seed=k) * 3).bfloat16()
    w = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5
    dev = triton_device()
    xq, h, kept = rms_norm_fake_quantize_rows(x.to(dev), w.to(dev), 1e-6, capture=True, backend="triton")
    assert xq.shape == h.shape == x.shape and xq.dtype == h.dtype == torch.bfloat16
    want_h = F.rms_norm(x, (k,), w, 1e-6)
    _assert_torch_rounding(h, want_h, exact=False)  # the sum of squares' order differs everywhere
    _assert_quantized_from(xq, kept, h)
    same = (h.cpu() == want_h).all(1)  # rows the kernel normed exactly as torch: the composition's bits
    assert_bitwise_equal(xq.cpu()[same], fake_quantize_rows(want_h[same], backend="torch")[0])
    # the torch path is that composition
    xq_t, h_t, kept_t = rms_norm_fake_quantize_rows(x, w, 1e-6, capture=True, backend="torch")
    assert_bitwise_equal(h_t, want_h)
    _assert_quantized_from(xq_t, kept_t, want_h)
    assert rms_norm_fake_quantize_rows(x, w, 1e-6, backend="torch")[2] is None


@pytest.mark.parametrize("rows, k, splits", [(9, 256, 3), (4, 2048, 2), (5, 96, 0), (0, 64, 2)])
def test_add_rms_norm_fake_quantize_sums_first(rows, k, splits):
    """x = residual + the product (its FP32 partial products added in split order, then rounded
    to BF16; or a BF16 product), computed in the kernel: x as float64 math makes it, and the rest
    as rms_norm_fake_quantize_rows of that x."""
    gen = torch.Generator().manual_seed(rows + k)
    residual = (heavy_tailed(rows, k, seed=k + 1) * 2).bfloat16()
    product = torch.randn(max(splits, 1), rows, k, generator=gen) * 4
    acc = product[0].double()
    for z in range(1, splits):  # FP32 adds in split order: each float64 add of two floats exact, then rounded
        acc = (acc + product[z].double()).float().double()
    want_x = (acc.float().bfloat16().double() + residual.double()).float().bfloat16()
    if not splits:
        product = product[0].bfloat16()
        want_x = (product.double() + residual.double()).float().bfloat16()
    w = torch.rand(k, generator=gen) + 0.5
    dev = triton_device()
    for backend, on in (("triton", dev), ("torch", "cpu")):
        xq, h, kept, x = add_rms_norm_fake_quantize_rows(product.to(on), residual.to(on), w.to(on), 1e-6,
                                                         capture=True, backend=backend)
        assert_bitwise_equal(x.cpu(), want_x)
        want_xq, want_h, want_kept = rms_norm_fake_quantize_rows(want_x.to(on), w.to(on), 1e-6, capture=True,
                                                                 backend=backend)
        assert_bitwise_equal(h.cpu(), want_h.cpu())
        assert_bitwise_equal(xq.cpu(), want_xq.cpu())
        for got, ref in zip(kept, want_kept, strict=True):
            assert torch.equal(got.cpu(), ref.cpu())


@pytest.mark.parametrize("rows, i", [(64, 768), (7, 96), (1, 16), (0, 32)])
def test_silu_mul_is_torchs(rows, i):
    g = torch.Generator().manual_seed(i)
    gate_up = (torch.randn(rows, 2 * i, generator=g) * torch.exp(torch.randn(1, 2 * i, generator=g))).bfloat16()
    gate_up[:, :4] = torch.tensor([0.0, -0.0, 30.0, -90.0]).bfloat16()  # zeros and saturated tails
    dev = triton_device()
    want = F.silu(gate_up[:, :i].to(dev)) * gate_up[:, i:].to(dev)  # torch on the kernel's device
    got = silu_mul(gate_up.to(dev), backend="triton")
    _assert_torch_rounding(got, want, exact=dev == "cuda")
    assert_bitwise_equal(silu_mul(gate_up, backend="torch"), F.silu(gate_up[:, :i]) * gate_up[:, i:])
    # fused with the fake quantize: the same rows, quantized as the reference quantizes them
    xq, act, kept = silu_mul_fake_quantize_rows(gate_up.to(dev), capture=True, backend="triton")
    assert_bitwise_equal(act.cpu(), got.cpu())
    _assert_quantized_from(xq, kept, act)
    xq_t, act_t, kept_t = silu_mul_fake_quantize_rows(gate_up, capture=True, backend="torch")
    _assert_quantized_from(xq_t, kept_t, act_t)


@pytest.mark.parametrize("rows, i", [(64, 768), (7, 96), (1, 16), (0, 32)])
def test_silu_mul_backward_is_torchs_autograd(rows, i):
    """Against torch's autograd of F.silu(gate) * up on the kernel's device: d_up bit for bit
    where torch runs on the same device (it is one product of BF16 values), d_gate within
    one BF16 ulp (torch's silu_backward may contract its float32 expression into FMAs)."""
    g = torch.Generator().manual_seed(i + 1)
    gate_up = (torch.randn(rows, 2 * i, generator=g) * torch.exp(torch.randn(1, 2 * i, generator=g))).bfloat16()
    gate_up[:, :4] = torch.tensor([0.0, -0.0, 30.0, -90.0]).bfloat16()
    grad = torch.randn(rows, i, generator=g).bfloat16()
    dev = triton_device()
    leaf = gate_up.to(dev).clone().requires_grad_()
    gate, up = leaf.chunk(2, -1)
    (F.silu(gate) * up).backward(grad.to(dev))
    got = silu_mul_backward(grad.to(dev), gate_up.to(dev), backend="triton")
    assert got.shape == gate_up.shape and got.dtype == torch.bfloat16
    _assert_torch_rounding(got[:, i:], leaf.grad[:, i:], exact=dev == "cuda")
    _assert_torch_rounding(got[:, :i], leaf.grad[:, :i], exact=False)
    # the torch path is autograd's own arithmetic
    leaf_cpu = gate_up.clone().requires_grad_()
    gate, up = leaf_cpu.chunk(2, -1)
    (F.silu(gate) * up).backward(grad)
    assert_bitwise_equal(silu_mul_backward(grad, gate_up, backend="torch"), leaf_cpu.grad)
    with pytest.raises(ValueError, match="grad must be"):
        silu_mul_backward(grad.float(), gate_up)


def test_fused_inputs_refuse_what_does_not_fit():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        rms_norm_fake_quantize_rows(x.float(), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_fake_quantize_rows(x, torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="multiple of 16"):
        rms_norm_fake_quantize_rows(torch.zeros(2, 24, dtype=torch.bfloat16), torch.ones(24), 1e-6)
    with pytest.raises(ValueError, match="multiple of 32"):
        silu_mul_fake_quantize_rows(torch.zeros(2, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 2"):
        silu_mul(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="product must be"):
        add_rms_norm_fake_quantize_rows(torch.zeros(2, 3, 32), x, torch.ones(32), 1e-6)
