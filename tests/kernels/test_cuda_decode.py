"""The CUDA C++ FP4 decode kernels (trace_kernels.fp4.cuda_decode): paged attention and the
grouped / dense GEMM.

On the CPU: their shared in-register dequantization, the source's own bit expressions evaluated
with numpy, against `dequantize` for every code byte under every E4M3 scale. On a GPU of compute
capability >= 9.0: the kernels against float64 math, the torch paths and the Triton kernels."""

import math
import re

import ml_dtypes
import numpy as np
import pytest
import torch
from trace_kernels.fp4 import Format, QTensor, cuda_decode, dequantize, quantize
from trace_kernels.fp4.linear import fp4_grouped_linear, fp4_linear
from trace_kernels.fp4.paged_attention import paged_decode_attention

from .helpers import heavy_tailed, paged_fp4_cache

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
gpu = pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of compute capability >= 9.0")


def _kernel_expression(name: str):
    """numpy function of a `u32 name = ...;` line of the kernel source (hex literals lose their u)."""
    src = (cuda_decode.KERNEL_DIR / "fp4_mma.cuh").read_text()
    expr = re.search(rf"u32 {name} = (.*?);", src).group(1)
    expr = re.sub(r"(0x[0-9A-Fa-f]+)u", r"np.uint32(\1)", expr)
    return lambda w: eval(expr, {"np": np, "w": w})  # noqa: S307 - the repository's own source


def test_register_dequantization_is_dequantize_bit_for_bit():
    """Every packed byte (both nibbles, all 16 codes) under every finite positive E4M3 scale and
    global scales from tiny to huge: the kernel's steps (E4M3 bytes worth e2m1 / 64, f16 product
    with the scale, FP32 product with 64 g, BF16 rounding) give `dequantize`'s BF16 bits."""
    codes = np.arange(256, dtype=np.uint32)
    words = codes | (codes << 8) | (codes << 16) | (codes << 24)  # a byte in each lane of the word
    even, odd = _kernel_expression("even")(words), _kernel_expression("odd")(words)
    for g in (1.0, 3.7e-5, 0.3172, 9.1e4, 1.0e30):
        for sb in range(0, 127):
            s = np.array([sb], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
            g64 = np.float32(np.float32(g) * np.float32(64))
            got = []
            for bytes_ in (even, odd):
                e = (bytes_ & 0xFF).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
                prod = e * s  # the f16x2 multiply: exact, so the rounding mode does not matter
                assert np.array_equal(prod.astype(np.float64), e.astype(np.float64) * s.astype(np.float64))
                got.append((prod.astype(np.float32) * g64).astype(ml_dtypes.bfloat16))
            rows = torch.from_numpy(codes.astype(np.uint8))[:, None].expand(256, 16).contiguous()  # 32 elements
            q = QTensor(rows, torch.full((256, 2), sb, dtype=torch.uint8).view(torch.float8_e4m3fn),
                        torch.full((256, 1), g, dtype=torch.float32), Format.NVFP4, torch.Size((256, 32)))
            want = dequantize(q, torch.bfloat16).view(torch.int16).numpy()
            assert np.array_equal(got[0].view(np.int16), want[:, 0]), (g, sb)
            assert np.array_equal(got[1].view(np.int16), want[:, 1]), (g, sb)


def _exact(q, rows, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // rows[0][0].shape[1]
    for i, (k, v) in enumerate(rows):
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, -1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


@gpu
@pytest.mark.parametrize("hq, hkv, block_size, split", [(32, 4, 16, {}), (16, 1, 32, {"min_chunk": 32, "max_splits": 4}),
                                                        (4, 2, 16, {"min_chunk": 64, "max_splits": 1}),
                                                        (12, 1, 48, {"min_chunk": 32, "max_splits": 8})])
def test_cuda_kernel_is_float64_attention(hq, hkv, block_size, split):
    """Groups of 8, 16, 2 and 12 query heads; sequences of 1 token up to several chunks, none a
    multiple of 16 but one; garbage in the unused slots."""
    lens = [1, 7, 16, 45, 300, 1029]
    cache, tables, seq_lens, rows = paged_fp4_cache(lens, hkv, 128, block_size, seed=hq + block_size, garbage=True)
    q = torch.randn(len(lens), hq, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    scale = 1 / math.sqrt(128)
    exact = _exact(q, rows, scale)
    dev = [{k: t.cuda() for k, t in c.items()} for c in cache]
    outs = {}
    for backend in ("cuda", "triton"):
        outs[backend] = paged_decode_attention(q.cuda(), dev[0], dev[1], tables.cuda(), seq_lens.cuda(), block_size,
                                               **split, backend=backend).cpu()
        torch.testing.assert_close(outs[backend].double(), exact, atol=0.02, rtol=2 * 2.0**-8,
                                   msg=lambda m, backend=backend: f"{backend}: {m}")
    assert not outs["cuda"].isnan().any()
    # the two kernels round the same values and differ in summation order only
    torch.testing.assert_close(outs["cuda"].float(), outs["triton"].float(), atol=4e-3, rtol=2 * 2.0**-8)


@gpu
def test_cuda_kernel_reads_v_bit_for_bit():
    """A one-token context makes softmax weight 1, so the output is that token's V row: the
    kernel's dequantization of V must equal `dequantize` exactly, over all 16 codes and scales
    from 2**-9 to 448 (with g spread over 2**-60 .. 2**40). Also the CUDA kernel at its default
    occupancy and at the others bench/decode_kernels.py --sweep tries."""
    hkv, n = 4, 16 * 256
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n, hkv, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(1, 127, (n, hkv, 8), dtype=torch.uint8, generator=g)
    gs = torch.exp2(torch.randint(-60, 40, (n, hkv, 1), generator=g).float()) * (1 + torch.rand(n, hkv, 1, generator=g))
    v = {"codes": codes, "scales": scales, "g": gs}
    k = {"codes": codes.flip(0).contiguous(), "scales": scales.flip(0).contiguous(), "g": gs.flip(0).contiguous()}
    tables = torch.arange(n // 16, dtype=torch.int32).view(-1, 1)  # sequence i: the first slot of block i
    b = tables.shape[0]
    q = torch.randn(b, 8 * hkv, 128, generator=g).bfloat16()
    out = paged_decode_attention(q.cuda(), {k_: t.cuda() for k_, t in k.items()}, {k_: t.cuda() for k_, t in v.items()},
                                 tables.cuda(), torch.ones(b, dtype=torch.int32, device="cuda"), 16,
                                 backend="cuda").cpu()
    slot = tables[:, 0].long() * 16
    want = dequantize(QTensor(codes[slot], scales[slot].view(torch.float8_e4m3fn), gs[slot], Format.NVFP4,
                              torch.Size((b, hkv, 128))), torch.bfloat16)
    # values, not bits: the MMA sums p * v onto a +0.0 accumulator, so a -0.0 element comes out +0.0
    assert torch.equal(out, want.repeat_interleave(8, 1))


def test_cuda_backend_refuses_what_it_cannot_run():
    q = torch.randn(2, 8, 128).bfloat16()
    cache = {"codes": torch.zeros(32, 2, 64, dtype=torch.uint8), "scales": torch.zeros(32, 2, 8, dtype=torch.uint8),
             "g": torch.ones(32, 2, 1)}
    with pytest.raises(ValueError, match="backend='cuda' needs an FP4 cache on a GPU"):
        paged_decode_attention(q, cache, cache, torch.zeros(2, 2, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 16, backend="cuda")


def _experts(e, n, k, seed):
    """e NVFP4 expert weights [n, k] with different global scales, scales from subnormal E4M3 up,
    and every code in the first row."""
    ws = [quantize(heavy_tailed(n, k, seed=seed + i) * (i + 1) * torch.logspace(-8, 4, n, base=2.0)[:, None])
          for i in range(e)]
    for w in ws:
        w.codes[0, :16] = torch.arange(0, 256, 0x11, dtype=torch.uint8)
    return ws


@gpu
@pytest.mark.parametrize("counts", [[3, 0, 17, 1, 9], [0, 0, 40, 0, 0], [16, 8, 1, 0, 33], [0, 0, 0, 0, 0]])
def test_cuda_grouped_gemm_is_each_experts_matmul(counts):
    """Experts with no rows, one n8 tile, two, and several 16-row tiles; K = 384 (three chunks)."""
    e, n, k = len(counts), 96, 384
    experts = _experts(e, n, k, seed=sum(counts))
    codes = torch.stack([w.codes for w in experts]).cuda()
    scales = torch.stack([w.block_scales for w in experts]).cuda()
    gs = torch.stack([w.global_scale for w in experts]).cuda()
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(1)).bfloat16()
    c = torch.tensor(counts).cuda()
    y = fp4_grouped_linear(x.cuda(), codes, scales, gs, c, backend="cuda").cpu()
    y_triton = fp4_grouped_linear(x.cuda(), codes, scales, gs, c, backend="triton").cpu()
    start = 0
    for w, m in zip(experts, counts, strict=True):
        wd = dequantize(w, torch.bfloat16).double()
        exact = x[start:start + m].double() @ wd.T
        size = x[start:start + m].double().abs() @ wd.abs().T  # bounds the FP32 summation error
        for got in (y, y_triton):  # one BF16 rounding of an FP32-accumulated product
            assert ((got[start:start + m].double() - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-20 * size).all()
        start += m


@gpu
def test_cuda_grouped_gemm_dequantizes_weights_bit_for_bit():
    """One-hot rows of x make each output one weight element times 1: the kernel's in-register
    weights must be `dequantize`'s BF16 values exactly, for every code and scales from 2**-9 up."""
    e, n, k = 3, 64, 256
    experts = _experts(e, n, k, seed=5)
    counts = [16, 16, 16]
    x = torch.cat([torch.eye(k)[i * 16:(i + 1) * 16] for i in range(e)]).bfloat16()  # expert i: columns 16i..
    y = fp4_grouped_linear(x.cuda(), torch.stack([w.codes for w in experts]).cuda(),
                           torch.stack([w.block_scales for w in experts]).cuda(),
                           torch.stack([w.global_scale for w in experts]).cuda(), torch.tensor(counts).cuda(),
                           backend="cuda").cpu()
    for i, w in enumerate(experts):
        want = dequantize(w, torch.bfloat16)[:, 16 * i:16 * (i + 1)].T  # [16 rows, n]
        assert torch.equal(y[16 * i:16 * (i + 1)], want)


@gpu
@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (5, 160, 2048), (17, 96, 768), (64, 2048, 256), (64, 5120, 2048)])
def test_cuda_dense_gemm_is_the_dequantized_matmul(m, n, k):
    w = quantize(heavy_tailed(n, k, seed=m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    wd = dequantize(w, torch.bfloat16).double()
    exact, size = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    y = fp4_linear(x.cuda(), w.to("cuda"), backend="cuda").cpu()  # K split across programs where K allows
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-20 * size).all()
    assert torch.equal(fp4_linear(x.cuda(), w.to("cuda")).cpu(), y)  # "auto" takes the CUDA kernel for decode M


def test_cuda_gemm_backend_refuses_what_it_cannot_run():
    w = quantize(torch.randn(64, 128))
    with pytest.raises(ValueError, match="backend='cuda' needs x on a GPU"):
        fp4_linear(torch.randn(2, 128).bfloat16(), w, backend="cuda")
    with pytest.raises(ValueError, match="3 splits do not divide K=256"):
        cuda_decode.grouped_linear(torch.zeros(1, 256).bfloat16(), torch.zeros(1, 32, 128, dtype=torch.uint8),
                                   torch.zeros(1, 32, 16, dtype=torch.uint8), torch.ones(1),
                                   torch.zeros(1, 3, dtype=torch.int32), 1, splits=3)
