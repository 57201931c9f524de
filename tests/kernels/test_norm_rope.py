"""RMSNorm and per-head norm + RoPE kernels (trace_kernels.norm_rope) against torch's own
F.rms_norm and rotary code: under TRITON_INTERPRET=1 on the CPU (CI) and on a GPU."""

import pytest
import torch
import torch.nn.functional as F
from trace_kernels.norm_rope import qk_norm_rope, rms_norm, rope

from .helpers import heavy_tailed, triton_device


def _assert_torch_rounding(got, want):
    """Equal but for the sum of squares' order: at most one BF16 ulp apart, almost all equal."""
    got, want = got.float().cpu(), want.float().cpu()
    ulp = torch.where(want == 0, torch.full_like(want, 2.0**-133), want.abs() * 2.0**-7)
    assert ((got - want).abs() <= ulp).all()
    assert (got == want).float().mean() >= 0.999


@pytest.mark.parametrize("rows, n", [(37, 2048), (5, 128), (3, 96), (1, 64)])
def test_rms_norm_is_torchs_composite(rows, n):
    x = (heavy_tailed(rows, n, seed=n) * 3).bfloat16()
    w = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5
    want = F.rms_norm(x, (n,), w, 1e-6)  # torch's composite (BF16 input, FP32 weight)
    got = rms_norm(x.to(triton_device()), w.to(triton_device()), 1e-6, backend="triton")
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    _assert_torch_rounding(got, want)
    assert torch.equal(rms_norm(x, w, 1e-6, backend="torch"), want)


@pytest.mark.parametrize("n, groups, g, d", [(9, 4, 8, 128), (3, 2, 2, 16), (1, 1, 1, 64)])
def test_qk_norm_rope_is_norm_then_rope(n, groups, g, d):
    gen = torch.Generator().manual_seed(n + d)
    qkv = (torch.randn(n, groups, g + 2, d, generator=gen) * 2).bfloat16()
    wq, wk = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    pos = torch.arange(n).float()[:, None] * (1e4 ** -(torch.arange(0, d, 2) / d))[None]
    emb = torch.cat([pos, pos], -1)[:, None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    want_q = rope(F.rms_norm(qkv[:, :, :g].reshape(n, groups * g, d), (d,), wq, 1e-6), cos, sin)
    want_k = rope(F.rms_norm(qkv[:, :, -2], (d,), wk, 1e-6), cos, sin)
    dev = triton_device()
    q, k = qk_norm_rope(qkv.to(dev), wq.to(dev), wk.to(dev), 1e-6, cos.to(dev), sin.to(dev), backend="triton")
    assert q.shape == (n, groups * g, d) and k.shape == (n, groups, d)
    _assert_torch_rounding(q, want_q)
    _assert_torch_rounding(k, want_k)
    tq, tk = qk_norm_rope(qkv, wq, wk, 1e-6, cos, sin, backend="torch")
    assert torch.equal(tq, want_q) and torch.equal(tk, want_k)


def test_norm_kernels_refuse_what_does_not_fit():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="does not fit rows of 64"):
        rms_norm(x, torch.ones(32), 1e-6)
    qkv = torch.randn(2, 1, 3, 16).bfloat16()
    with pytest.raises(ValueError, match="qk_norm_rope"):
        qk_norm_rope(qkv, torch.ones(16), torch.ones(16), 1e-6, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
