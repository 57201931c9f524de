"""The experts' gate scaling: one pass each way, the bits of torch's mixed-dtype expression."""

import torch

from megatron_trace.megatron.experts import scale_rows


def test_scale_rows_gives_the_bits_and_gradients_of_the_float32_product_rounded_once():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 64, generator=g) * 3).bfloat16().requires_grad_()
    p = torch.rand(300, generator=g).requires_grad_()
    up = torch.randn(300, 64, generator=g).bfloat16()
    got = scale_rows(x, p)
    got.backward(up)
    x2, p2 = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    want = (x2 * p2.unsqueeze(-1)).to(torch.bfloat16)
    want.backward(up)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(x.grad, x2.grad) and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(p.grad, p2.grad, rtol=0, atol=0)
    # and against float64: the exact product (8 x 24 significand bits fit in 53) rounded to float32, then BF16
    exact = x.detach().double() * p.detach().double().unsqueeze(-1)
    assert torch.equal(got, exact.float().bfloat16())
