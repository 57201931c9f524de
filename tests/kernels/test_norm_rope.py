"""RMSNorm and per-head norm + RoPE kernels (trace_kernels.norm_rope) against torch's own
F.rms_norm and rotary code: under TRITON_INTERPRET=1 on the CPU (CI) and on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.fp4 import heavy_tailed, triton_device
from trace_kernels.fp4 import quantize_rows_into
from trace_kernels.norm_rope import (
    qk_norm_rope,
    qk_norm_rope_into_cache,
    rms_norm,
    rms_norm_backward,
    rope,
    rope_rows,
)


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


def _rms_norm_grads_float64(x, w, grad, eps):
    """dx, dweight of x * rsqrt(mean(x^2) + eps) * w by autograd in float64: the reference."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    return torch.autograd.grad(y, (x64, w64), grad.double())


# rows of several tiles and backward programs (a head's 128: 16 rows a tile, 16 tiles a program),
# ragged ends, one row, none
@pytest.mark.parametrize("rows, n", [(37, 2048), (300, 128), (5, 96), (1, 64), (0, 128)])
def test_rms_norm_backward_against_float64(rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    x = (heavy_tailed(max(rows, 1), n, seed=n) * 3)[:rows].bfloat16()
    w = torch.rand(n, generator=gen) + 0.5
    grad = torch.randn(rows, n, generator=gen).bfloat16()
    dev = triton_device()
    dx, dw = rms_norm_backward(grad.to(dev), x.to(dev), w.to(dev), 1e-6, backend="triton")
    tdx, tdw = rms_norm_backward(grad, x, w, 1e-6, backend="torch")  # autograd through torch's composite
    assert dx.dtype == torch.bfloat16 and dx.shape == x.shape and dw.dtype == torch.float32 and dw.shape == (n,)
    if not rows:
        assert torch.equal(dw.cpu(), torch.zeros(n))
        return
    rdx, rdw = _rms_norm_grads_float64(x, w, grad, 1e-6)
    # dx rounded to BF16 once from FP32: within one BF16 ulp of the exact value, as torch's
    scale = rdx.abs().amax(-1, keepdim=True)
    assert ((dx.cpu().double() - rdx).abs() <= rdx.abs() * 2.0**-8 + scale * 2.0**-16).all()
    assert ((tdx.double() - rdx).abs() <= rdx.abs() * 2.0**-8 + scale * 2.0**-16).all()
    # dweight: FP32 sums over the rows, in another order than torch's
    tol = 1e-5 * rdw.abs().max()
    assert (dw.cpu().double() - rdw).abs().max() <= tol and (tdw.double() - rdw).abs().max() <= tol


def test_rms_norm_backward_rejects_a_gradient_of_another_shape():
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad"):
        rms_norm_backward(torch.ones(4, 9, dtype=torch.bfloat16), x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="bfloat16"):
        dev = triton_device()
        rms_norm_backward(x.float().to(dev), x.float().to(dev), torch.ones(8, device=dev), 1e-6, backend="triton")


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


def _rope_tables(n, d):
    pos = torch.arange(n).float()[:, None] * (1e4 ** -(torch.arange(0, d, 2) / d))[None]
    emb = torch.cat([pos, pos], -1)[:, None]
    return emb.cos().bfloat16(), emb.sin().bfloat16()


def _split_products(n, groups, g, d, splits, seed):
    """FP32 partial products [splits, n, groups, g + 2, d] and the qkv they make: added in split
    order, each add rounded to FP32 (float64 adds of two floats are exact, then rounded), and
    the sum rounded to BF16."""
    gen = torch.Generator().manual_seed(seed)
    parts = torch.randn(splits, n, groups, g + 2, d, generator=gen) * 3
    acc = parts[0].double()
    for z in range(1, splits):  # FP32 adds, one at a time in split order
        acc = (acc + parts[z].double()).float().double()
    return parts, acc.float().bfloat16()


@pytest.mark.parametrize("splits", [2, 3])
def test_qk_norm_rope_sums_split_products_first(splits):
    n, groups, g, d = 5, 2, 3, 64
    parts, qkv = _split_products(n, groups, g, d, splits, seed=splits)
    wq, wk = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    cos, sin = _rope_tables(n, d)
    dev = triton_device()
    for backend, on in (("triton", dev), ("torch", "cpu")):
        q, k = qk_norm_rope(parts.to(on), wq.to(on), wk.to(on), 1e-6, cos.to(on), sin.to(on), backend=backend)
        want_q, want_k = qk_norm_rope(qkv.to(on), wq.to(on), wk.to(on), 1e-6, cos.to(on), sin.to(on),
                                      backend=backend)
        assert torch.equal(q.cpu(), want_q.cpu()) and torch.equal(k.cpu(), want_k.cpu())


def _empty_cache(slots, groups, d, fp4):
    if fp4:
        return {"codes": torch.zeros(slots, groups, d // 2, dtype=torch.uint8),
                "scales": torch.zeros(slots, groups, d // 16, dtype=torch.uint8),
                "g": torch.ones(slots, groups, 1)}
    return {"rows": torch.zeros(slots, groups, d, dtype=torch.bfloat16)}


@pytest.mark.parametrize("fp4", [True, False])
@pytest.mark.parametrize("splits, d", [(0, 128), (2, 128), (2, 16)])
def test_qk_norm_rope_into_cache_stores_keys_and_values(fp4, splits, d):
    """Queries as qk_norm_rope of the same backend; the cache afterwards holds, at the slots and
    nowhere else, the keys that qk_norm_rope returns and qkv's values: as quantize_rows_into
    (torch reference) stores them in FP4, as they are in BF16. (Head dim 16: an FP4 block spans
    both rotary halves, so the Triton path composes the separate kernels.) Triton's keys may
    differ from torch's by a BF16 ulp (the sum of squares' order), so each backend is held to
    its own qk_norm_rope, and Triton's queries to torch's rounding."""
    n, groups, g, num_slots = 6, 2, 2, 20
    parts, qkv = _split_products(n, groups, g, d, max(splits, 1), seed=7 + splits)
    for t in (qkv, parts):
        t[..., 0, 1, -1, :] = 0.0  # an all-zero value row: scale 1, g 1
        t[..., 1, 0, -1, :16] = 0.0  # an all-zero block
    gen = torch.Generator().manual_seed(d + splits)
    wq, wk = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    cos, sin = _rope_tables(n, d)
    slots = torch.tensor([3, 17, 0, 9, 12, 5])
    src = parts if splits else qkv
    torch_q, _ = qk_norm_rope(qkv, wq, wk, 1e-6, cos, sin, backend="torch")
    dev = triton_device()
    for backend, on in (("triton", dev), ("torch", "cpu")):
        args = (wq.to(on), wk.to(on), 1e-6, cos.to(on), sin.to(on))
        want_q, want_k = (t.cpu() for t in qk_norm_rope(src.to(on), *args, backend=backend))
        want_k_cache = _empty_cache(num_slots, groups, d, fp4)
        want_v_cache = _empty_cache(num_slots, groups, d, fp4)
        for cache, rows in ((want_k_cache, want_k), (want_v_cache, qkv[:, :, -1])):
            if fp4:
                quantize_rows_into(rows, slots, cache["codes"], cache["scales"], cache["g"], backend="torch")
            else:
                cache["rows"][slots] = rows
        k_cache = {t: v.to(on) for t, v in _empty_cache(num_slots, groups, d, fp4).items()}
        v_cache = {t: v.to(on) for t, v in _empty_cache(num_slots, groups, d, fp4).items()}
        q = qk_norm_rope_into_cache(src.to(on), *args, k_cache, v_cache, slots.to(on), backend=backend)
        assert torch.equal(q.cpu(), want_q), backend
        _assert_torch_rounding(q, torch_q)
        for got, want in ((k_cache, want_k_cache), (v_cache, want_v_cache)):
            for name in want:
                assert torch.equal(got[name].cpu(), want[name]), (backend, name)


def test_norm_kernels_refuse_what_does_not_fit():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="does not fit rows of 64"):
        rms_norm(x, torch.ones(32), 1e-6)
    qkv = torch.randn(2, 1, 3, 16).bfloat16()
    with pytest.raises(ValueError, match="qk_norm_rope"):
        qk_norm_rope(qkv, torch.ones(16), torch.ones(16), 1e-6, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    q_ok = torch.randn(2, 1, 3, 32).bfloat16()
    cache = _empty_cache(4, 1, 32, fp4=True)
    with pytest.raises(ValueError, match="slots must be int64"):
        qk_norm_rope_into_cache(q_ok, torch.ones(32), torch.ones(32), 1e-6, torch.ones(2, 1, 32), torch.ones(2, 1, 32),
                                cache, _empty_cache(4, 1, 32, fp4=True), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="v_cache must hold"):
        qk_norm_rope_into_cache(q_ok, torch.ones(32), torch.ones(32), 1e-6, torch.ones(2, 1, 32), torch.ones(2, 1, 32),
                                cache, _empty_cache(4, 2, 32, fp4=True), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32 partial products"):
        qk_norm_rope(q_ok.float(), torch.ones(32), torch.ones(32), 1e-6, torch.ones(2, 1, 32), torch.ones(2, 1, 32))


@pytest.mark.parametrize("rope", [
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
    dict(factor=4.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.8),
], ids=["deepseek-v3", "tiny"])
def test_yarn_frequencies_and_scales_are_transformers(rope):
    """YaRN's inverse frequencies and cos/sin factor against transformers' own YaRN initialisation
    (DeepSeek-V3's released values, and the tiny test model's), on a 64-channel rope part."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trace_kernels.norm_rope import yarn_inv_freq, yarn_mscale

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0, **rope}
    cfg = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=params, max_position_embeddings=163840)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got = yarn_inv_freq(10000.0, 64, rope["factor"], rope["original_max_position_embeddings"])
    assert torch.equal(got, want.float())
    assert yarn_mscale(rope["factor"], rope["mscale"]) / yarn_mscale(rope["factor"], rope["mscale_all_dim"]) == \
        pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("shape", [(9, 3, 128), (4, 2, 5, 96)])
def test_rope_rows_and_its_gradient_are_autograds_through_torchs_rope(shape):
    """Forward: x * cos + rotate_half(x) * sin in BF16 ops; transpose: the gradient autograd takes
    through that expression. The kernel (interpreter or GPU) and the torch path, bit for bit."""
    gen = torch.Generator().manual_seed(shape[-1])
    n, d = shape[0], shape[-1]
    x = (torch.randn(*shape, generator=gen) * 3).bfloat16()
    up = torch.randn(*shape, generator=gen).bfloat16()
    ang = torch.rand(n, d, generator=gen) * 50
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    xr = x.clone().requires_grad_()
    c, s = (t.view(n, *([1] * (len(shape) - 2)), d) for t in (cos, sin))
    want = xr * c + torch.cat([-xr[..., d // 2:], xr[..., :d // 2]], -1) * s
    want.backward(up)
    dev = triton_device()
    for backend, where in (("triton", dev), ("torch", "cpu")):
        y = rope_rows(x.to(where), cos.to(where), sin.to(where), backend=backend)
        dx = rope_rows(up.to(where), cos.to(where), sin.to(where), transpose=True, backend=backend)
        assert torch.equal(y.cpu(), want.detach()) and torch.equal(dx.cpu(), xr.grad), backend
    with pytest.raises(ValueError, match="cos and sin"):
        rope_rows(x, cos[:-1], sin[:-1])
    with pytest.raises(ValueError, match="bfloat16"):
        rope_rows(x.float().to(dev), cos.to(dev), sin.to(dev), backend="triton")
