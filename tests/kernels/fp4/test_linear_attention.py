"""FP4 weight GEMM and paged FP4 decode attention: Triton kernels against the torch paths and
float64 math. Under TRITON_INTERPRET=1 on the CPU (CI) and on a GPU where there is one."""

import math

import pytest
import torch

from tests.support.fp4 import heavy_tailed, paged_fp4_cache, triton_device
from trace_kernels.fp4 import dequantize, quantize
from trace_kernels.fp4.linear import expert_tiles, fp4_linear
from trace_kernels.fp4.paged_attention import paged_decode_attention

BF16_ULP = 2.0**-8


@pytest.mark.parametrize("m, n, k", [(1, 128, 64), (3, 64, 128), (17, 96, 256), (70, 64, 48)])
def test_fp4_linear_is_the_dequantized_matmul(m, n, k, monkeypatch):
    """Every backend within one BF16 rounding of the exact product; "auto" with every row count
    counted as prefill-sized (on a GPU: the weight dequantized once, then cuBLAS)."""
    import trace_kernels.fp4.linear as linear

    monkeypatch.setattr(linear, "DEQUANT_GEMM_ROWS", 1)
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = quantize(heavy_tailed(n, k, seed=m))
    exact = x.double() @ dequantize(w, torch.bfloat16).double().T  # the weight as the engine holds it
    dev = triton_device()
    for backend, args in (("torch", (x, w)), ("triton", (x.to(dev), w.to(dev))), ("auto", (x.to(dev), w.to(dev)))):
        y = fp4_linear(*args, backend=backend).cpu()
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # one BF16 rounding of the fp32-accumulated result: within an ulp of the exact product
        assert ((y.double() - exact).abs() <= BF16_ULP * exact.abs() + 1e-3).all(), backend


@pytest.mark.parametrize("n, k", [(64, 128), (96, 48), (128, 2048)])
def test_fp4_linear_dequantizes_weights_bit_for_bit(n, k):
    """Identity rows make every output one product 1 * w[n, k]: the GEMM's in-register
    dequantization must then give `dequantize`'s BF16 weight exactly: all 16 codes, under E4M3
    block scales from subnormal (rows scaled down 2**16 below the largest) to 448."""
    g = torch.Generator().manual_seed(n + k)
    w = quantize(heavy_tailed(n, k, seed=k) * torch.logspace(-10, 6, n, base=2.0)[:, None])
    w.codes[0, : 8] = torch.arange(0, 256, 0x11, dtype=torch.uint8)[: 8]  # every code, both nibbles
    x = torch.eye(k, dtype=torch.bfloat16)[torch.randperm(k, generator=g)[: min(k, 96)]]
    dev = triton_device()
    y = fp4_linear(x.to(dev), w.to(dev), backend="triton").cpu()
    want = x @ dequantize(w, torch.bfloat16).T
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_fp4_linear_refuses_what_it_cannot_compute():
    w = quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="tensor-scaled NVFP4"):
        fp4_linear(torch.randn(2, 32).bfloat16(), quantize(torch.randn(8, 32), scale="row"))
    with pytest.raises(ValueError, match=r"bfloat16 \[M, 32\]"):
        fp4_linear(torch.randn(2, 16).bfloat16(), w)


@pytest.mark.parametrize("hq, hkv, d, block_size, split", [(4, 2, 32, 4, {}),
                                                           (8, 8, 16, 16, {"min_chunk": 32, "max_splits": 2}),
                                                           (4, 1, 64, 8, {"min_chunk": 32, "max_splits": 2}),
                                                           (4, 2, 32, 4, {"min_chunk": 32, "max_splits": 1}),
                                                           (8, 1, 128, 16, {})])
def test_paged_decode_attention_reads_the_fp4_cache(hq, hkv, d, block_size, split):
    """Split: min_chunk 32 in at most 2 splits attends the 40-token sequence in two chunks of 32,
    then combines them; in 1 split its chunk doubles to 64 on the device."""
    lens = [1, 5, 13, 40]
    cache, tables, seq_lens, rows = paged_fp4_cache(lens, hkv, d, block_size, seed=hq + d)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(7)).bfloat16()
    scale = 1 / math.sqrt(d)
    exact = torch.empty(len(lens), hq, d, dtype=torch.float64)
    for i, (k, v) in enumerate(rows):  # float64 softmax attention over the dequantized rows
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, -1)
        exact[i] = torch.einsum("hn,nhd->hd", p, v)
    dev = triton_device()
    moved = [{k: t.to(dev) for k, t in c.items()} for c in cache]
    for backend in ("torch", "triton"):
        c = cache if backend == "torch" else moved
        out = paged_decode_attention(q.to(c[0]["codes"].device), c[0], c[1], tables.to(c[0]["codes"].device),
                                     seq_lens.to(c[0]["codes"].device), block_size, **split,
                                     backend=backend).cpu()
        torch.testing.assert_close(out.double(), exact, atol=0.02, rtol=2 * BF16_ULP,
                                   msg=lambda m, backend=backend: f"{backend}: {m}")
    # the same kernel on a BF16 cache holding the dequantized rows
    bf16 = [{"rows": torch.zeros(64 * block_size, hkv, d, dtype=torch.bfloat16)} for _ in range(2)]
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slot = tables[i].long()[pos // block_size] * block_size + pos % block_size
        for c, r in zip(bf16, rows[i], strict=True):
            c["rows"][slot] = r.bfloat16()
    moved = [{k: t.to(dev) for k, t in c.items()} for c in bf16]
    out = paged_decode_attention(q.to(dev), moved[0], moved[1], tables.to(dev), seq_lens.to(dev), block_size,
                                 **split, backend="triton").cpu()
    torch.testing.assert_close(out.double(), exact, atol=0.02, rtol=2 * BF16_ULP)


@pytest.mark.parametrize("counts", [[3, 0, 17, 1], [0, 0, 40, 0], [0, 0, 0, 0]])
def test_fp4_grouped_linear_is_each_experts_matmul(counts):
    from trace_kernels.fp4.linear import _dequantized_grouped_mm, fp4_grouped_linear

    e, n, k = 4, 96, 128
    g = torch.Generator().manual_seed(sum(counts))
    experts = [quantize(heavy_tailed(n, k, seed=i) * (i + 1)) for i in range(e)]  # a different g each
    codes = torch.stack([w.codes for w in experts])
    scales = torch.stack([w.block_scales for w in experts])
    gs = torch.stack([w.global_scale for w in experts])
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    want = torch.cat([fp4_linear(chunk, w, backend="torch")
                      for chunk, w in zip(x.split(counts), experts, strict=True)]) if sum(counts) else x.new_empty(0, n)
    dev = triton_device()
    for backend in ("torch", "triton"):
        on = "cpu" if backend == "torch" else dev
        y = fp4_grouped_linear(x.to(on), codes.to(on), scales.to(on), gs.to(on), torch.tensor(counts, device=on),
                               backend=backend).cpu()
        if backend == "torch":
            assert torch.equal(y, want), backend
        else:  # another accumulation order (even and odd columns apart): within one bf16 rounding
            torch.testing.assert_close(y.float(), want.float(), atol=1e-2, rtol=2 * BF16_ULP)
    # prefill sizes on a GPU: all experts dequantized in one launch, then torch's grouped GEMM
    y = _dequantized_grouped_mm(x.to(dev), codes.to(dev), scales.to(dev), gs.to(dev), torch.tensor(counts)).cpu()
    torch.testing.assert_close(y.float(), want.float(), atol=1e-2, rtol=2 * BF16_ULP)
    with pytest.raises(ValueError, match="counts sum to"):
        fp4_grouped_linear(x, codes, scales, gs, torch.tensor(counts[:-1] + [counts[-1] + 1]))
    with pytest.raises(ValueError, match="do not fit"):
        fp4_grouped_linear(x, codes, scales, gs, torch.tensor(counts[:-1]))
    # rows given as a map into token rows: each token row used several times, out of order
    tokens = x[::2].contiguous() if sum(counts) > 1 else x
    rows = torch.randint(0, tokens.shape[0], (sum(counts),), generator=g) if tokens.shape[0] else torch.zeros(0).long()
    assert torch.equal(fp4_grouped_linear(tokens, codes, scales, gs, torch.tensor(counts), x_rows=rows),
                       fp4_grouped_linear(tokens[rows], codes, scales, gs, torch.tensor(counts)))
    with pytest.raises(ValueError, match="x_rows must be int64"):
        fp4_grouped_linear(tokens, codes, scales, gs, torch.tensor(counts), x_rows=rows.int())


@pytest.mark.parametrize("shape, dtype", [((37, 64), torch.bfloat16), ((5, 256), torch.float32),
                                          ((9, 48), torch.float16)])
def test_fake_quantize_rows_in_one_pass(shape, dtype):
    """The fused kernel (fake quantization plus the capture of mantissa bits, block scales and
    global scales) against the float64 spec: the same codes, scales and g, the same dequantized
    values, and bits equal to the spec codes' lowest bit. Rows of zeros and of tiny values
    included."""
    from tests.support.spec64 import nvfp4
    from trace_kernels.fp4 import fake_quantize_rows, pack_bits

    x = heavy_tailed(*shape, seed=shape[0]) * torch.logspace(-30, 10, shape[0], base=2.0)[:, None]
    x[1] = 0.0
    x = x.to(dtype)
    codes, s, g = (torch.from_numpy(a) for a in nvfp4(x.double().numpy(), row_scale=True))
    magnitude = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes.long() & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude)  # float32, the sign of zero aside
    # (e2m1 * s) * g in float32 (e2m1 * s is exact), then x's dtype
    want = ((values.reshape(shape[0], -1, 16) * s[..., None]) * g.float()[..., None]).reshape(shape).to(dtype)
    scales = s.to(torch.float8_e4m3fn).view(torch.uint8)  # s holds E4M3 values: exact
    dev = triton_device()
    for backend in ("torch", "triton"):
        on = "cpu" if backend == "torch" else dev
        out, (bits, sb, gg) = fake_quantize_rows(x.to(on), capture=True, backend=backend)
        assert out.dtype == dtype
        assert torch.equal(out.cpu(), want), backend  # -0.0 == 0.0: the sign of zero is not compared
        assert torch.equal(bits.cpu(), pack_bits(codes & 1)), backend
        assert torch.equal(sb.cpu(), scales), backend
        assert torch.equal(gg.cpu(), g.reshape(-1).float()), backend
        plain, none = fake_quantize_rows(x.to(on), backend=backend)
        assert none is None and torch.equal(plain.cpu(), out.cpu())
    with pytest.raises(ValueError, match="rows"):
        fake_quantize_rows(x[None])


def test_fp4_grouped_linear_many_experts():
    """40 experts, some without rows: the device-side tile list spans several programs."""
    from trace_kernels.fp4.linear import fp4_grouped_linear

    e, n, k = 40, 32, 32
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 4, (e,), generator=g)
    experts = [quantize(heavy_tailed(n, k, seed=i)) for i in range(e)]
    codes, scales = torch.stack([w.codes for w in experts]), torch.stack([w.block_scales for w in experts])
    gs = torch.stack([w.global_scale for w in experts])
    x = torch.randn(int(counts.sum()), k, generator=g).bfloat16()
    want = fp4_grouped_linear(x, codes, scales, gs, counts, backend="torch")
    dev = triton_device()
    y = fp4_grouped_linear(x.to(dev), codes.to(dev), scales.to(dev), gs.to(dev), counts.to(dev), backend="triton")
    torch.testing.assert_close(y.cpu().float(), want.float(), atol=1e-2, rtol=2 * BF16_ULP)
    # the tile list built once (as a layer does for fc1 and fc2) gives the same product
    tiles = expert_tiles(counts.to(dev), x.shape[0])
    shared = fp4_grouped_linear(x.to(dev), codes.to(dev), scales.to(dev), gs.to(dev), counts.to(dev), tiles=tiles,
                                backend="triton")
    assert torch.equal(shared, y)
    with pytest.raises(ValueError, match=f"tiles of {x.shape[0]} rows were not listed for {x.shape[0] - 1} rows"):
        fp4_grouped_linear(x[:-1].to(dev), codes.to(dev), scales.to(dev), gs.to(dev), counts.to(dev), tiles=tiles,
                           backend="triton")


def test_quantize_rows_into_a_paged_cache():
    """K / V rows (token, head) of a strided view (V is a slice of the fused qkv output) quantized
    and scattered into cache slots by one kernel: the float64 spec's codes, scales and g at those
    slots, every other slot untouched."""
    from tests.support.spec64 import nvfp4
    from trace_kernels.fp4 import pack_codes, quantize_rows_into

    n, heads, d, slots_total = 6, 3, 128, 20
    qkv = (heavy_tailed(n * heads * 4, d, seed=9).reshape(n, heads, 4, d)
           * torch.logspace(-20, 8, n)[:, None, None, None])
    qkv[2, 1] = 0.0  # a row of zeros
    x = qkv.bfloat16()[:, :, -1]  # strides (heads * 4 * d, 4 * d, 1)
    slots = torch.tensor([7, 0, 19, 3, 12, 8])
    codes, s, g = (torch.from_numpy(a) for a in nvfp4(x.double().reshape(n * heads, d).numpy(), row_scale=True))
    want = {"codes": pack_codes(codes).reshape(n, heads, d // 2),
            "scales": s.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, heads, d // 16),
            "g": g.float().reshape(n, heads, 1)}
    dev = triton_device()
    for backend in ("torch", "triton"):
        on = "cpu" if backend == "torch" else dev
        cache = {"codes": torch.full((slots_total, heads, d // 2), 0xAB, dtype=torch.uint8, device=on),
                 "scales": torch.full((slots_total, heads, d // 16), 0xCD, dtype=torch.uint8, device=on),
                 "g": torch.full((slots_total, heads, 1), -1.0, device=on)}
        quantize_rows_into(x.to(on), slots.to(on), cache["codes"], cache["scales"], cache["g"], backend=backend)
        others = torch.ones(slots_total, dtype=torch.bool)
        others[slots] = False
        for name, t in cache.items():
            t = t.cpu()
            assert torch.equal(t[slots], want[name]), (backend, name)
            assert (t[others] == {"codes": 0xAB, "scales": 0xCD, "g": -1.0}[name]).all(), (backend, name)
    with pytest.raises(ValueError, match="slots"):
        quantize_rows_into(x, slots[:-1], *cache.values())



@pytest.mark.parametrize("start, m", [(0, 40), (37, 11), (50, 1)])
def test_cached_causal_attention_masks_by_position_and_refuses_a_wrong_key_count(start, m):
    """Queries at start .. start + m - 1 (GQA) against float64 attention with the positions mask
    (on a GPU the path under torch's lower-right causal bias, flash attention; on the CPU the
    explicit mask); keys not covering exactly positions 0 .. start + m - 1 are refused."""
    from trace_kernels.fp4.paged_attention import cached_causal_attention

    g = torch.Generator().manual_seed(start + m)
    q, k, v = (torch.randn(n, h, 64, generator=g).bfloat16() for n, h in ((m, 8), (start + m, 2), (start + m, 2)))
    dev = triton_device()
    out = cached_causal_attention(q.to(dev), k.to(dev), v.to(dev), start).cpu()
    qd, kd, vd = (t.double() for t in (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)))
    scores = torch.einsum("mhd,nhd->hmn", qd, kd) / 8.0
    allowed = torch.arange(start + m)[None] <= (start + torch.arange(m))[:, None]
    ref = torch.einsum("hmn,nhd->mhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vd)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="cached keys"):
        cached_causal_attention(q, k[:-1], v[:-1], start)
