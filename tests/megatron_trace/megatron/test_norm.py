"""The trainer's RMSNorm: torch's F.rms_norm values and gradients, in one kernel each way where fused."""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_trace.megatron.norm import TraceRMSNorm, fused_rms_norm
from tests.support.fp4 import triton_device


def _grads(fn, x, w, up):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(up)
    return y.detach(), x.grad, w.grad


def test_fused_rms_norm_gives_torchs_values_and_gradients():
    """The fused path (a GPU, else the CPU interpreter) against autograd through torch's composite: the
    output within one BF16 ulp (the sum of squares' order), dx within one BF16 ulp, dweight to
    FP32 rounding; a strided input (a QK norm's view of qkv) included."""
    g, dev = torch.Generator().manual_seed(0), triton_device()
    qkv = (torch.randn(40, 6, 64, generator=g) * 3).bfloat16().to(dev)
    x = qkv[:, :4]  # [40, 4, 64], not contiguous
    w = (torch.rand(64, generator=g) + 0.5).to(dev)
    up = torch.randn(40, 4, 64, generator=g).bfloat16().to(dev)
    y, dx, dw = _grads(lambda a, b: fused_rms_norm(a, b, 1e-6, backend="triton"), x, w, up)
    ty, tdx, tdw = _grads(lambda a, b: torch.nn.functional.rms_norm(a, (64,), b, 1e-6), x, w, up)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert ((y.float() - ty.float()).abs() <= ty.float().abs() * 2.0**-7).all() and (y == ty).float().mean() > 0.99
    assert ((dx.float() - tdx.float()).abs() <= tdx.float().abs() * 2.0**-7 + 1e-6).all()
    torch.testing.assert_close(dw, tdw, rtol=1e-5, atol=1e-5)


def test_trace_rms_norm_is_torchs_on_the_cpu():
    """The module on the CPU (what CI trains with) is torch's composite itself, bit for bit."""
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    norm = TraceRMSNorm(cfg, 64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))
