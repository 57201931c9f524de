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

from tests.support.fp4 import heavy_tailed, paged_fp4_cache, triton_device
from trace_kernels.fp4 import Format, QTensor, cuda_decode, dequantize, quantize
from trace_kernels.fp4.linear import fp4_grouped_linear, fp4_linear
from trace_kernels.fp4.paged_attention import paged_decode_attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
gpu = pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of compute capability >= 9.0")


def _header_constants() -> dict[str, int]:
    """The `constexpr u32` constants of the kernels' dequantization header."""
    src = (cuda_decode.KERNEL_DIR / "fp4_mma.cuh").read_text()
    return {name: int(value, 16) for name, value in re.findall(r"constexpr u32 (\w+) = (0x[0-9A-Fa-f]+)u;", src)}


C = _header_constants()


def _prmt(a, b, selector):
    """PTX prmt.b32 (default mode) on uint32 arrays: output byte i is byte (nibble i & 7) of b:a,
    or that byte's sign replicated when nibble i has bit 3 set."""
    a, b, selector = (np.asarray(v, dtype=np.uint64) for v in (a, b, selector))
    pool = (b << np.uint64(32)) | a
    out = np.zeros(np.broadcast_shapes(a.shape, b.shape, selector.shape), np.uint64)
    for i in range(4):
        nibble = (selector >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
        byte = np.where(nibble & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def _pack_bf16(lo, hi):
    """cvt.rn.bf16x2.f32: two float32 values rounded to BF16 (nearest, even), lo in bits 0-15."""
    bits = [np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32) for v in (lo, hi)]
    return bits[0] | (bits[1] << np.uint32(16))


def _table(s: np.float32, g: np.float32):
    """`fp4_table_fast`, or `fp4_table_exact` where the header's range test sends it: the low /
    high byte planes of the 8 magnitudes' values (lo0, lo1, hi0, hi1)."""
    with np.errstate(over="ignore"):  # huge g: infinities, as on the GPU
        f1, f15 = s * g, (np.float32(1.5) * s) * g
        exact = [_pack_bf16((np.float32(a) * s) * g, (np.float32(b) * s) * g) for a, b in ((0, .5), (2, 3), (4, 6))]
    v23 = _pack_bf16(f1, f15)
    if _fast(f1):
        v01 = (v23 << np.uint32(16)) - np.uint32((C["BF16_DOUBLE"] << 16) & 0xFFFFFFFF)
        v45, v67 = v23 + np.uint32(C["BF16_DOUBLE"]), v23 + np.uint32(2 * C["BF16_DOUBLE"])
    else:
        v01, v45, v67 = exact
    return (_prmt(v01, v23, C["LO_BYTES"]), _prmt(v45, v67, C["LO_BYTES"]), _prmt(v01, v23, C["HI_BYTES"]),
            _prmt(v45, v67, C["HI_BYTES"]))


def _fast(f1: np.float32) -> bool:
    """The header's test for the fast table: (bits(s g) - FAST_MIN) mod 2**32 <= FAST_SPAN."""
    return (int(np.float32(f1).view(np.uint32)) - C["FAST_MIN"]) % 2**32 <= C["FAST_SPAN"]


def _planes(w, table):
    """`fp4_planes`: (lo_a, hi_a, lo_b, hi_b) of uint32 words w."""
    lo0, lo1, hi0, hi1 = table
    mag, w4 = w & np.uint32(C["MAGNITUDES"]), w << np.uint32(4)
    sign_a = _prmt(w, w4, C["SIGN_0123"]) & np.uint32(0x80808080)
    sign_b = _prmt(w, w4, C["SIGN_4567"]) & np.uint32(0x80808080)
    return (_prmt(lo0, lo1, mag), _prmt(hi0, hi1, mag) ^ sign_a, _prmt(lo0, lo1, mag >> np.uint32(16)),
            _prmt(hi0, hi1, mag >> np.uint32(16)) ^ sign_b)


def _dequant_word(w, table):
    """`dequant_word`: 4 bf16 pairs (elements 2p, 2p + 1) -> uint16 [len(w), 8] in element order."""
    lo_a, hi_a, lo_b, hi_b = _planes(w, table)
    pairs = [_prmt(lo, hi, sel) for lo, hi in ((lo_a, hi_a), (lo_b, hi_b)) for sel in (C["PAIR_01"], C["PAIR_23"])]
    return np.stack(pairs, -1).view(np.uint16)


def _dequant_word_pairs(x, tx, y, ty):
    """`dequant_word_pairs`: out[e] = (x_e, y_e) -> uint16 [len(x), 8, 2]."""
    a, b = _planes(x, tx), _planes(y, ty)
    out = []
    for half in (0, 1):
        lo_x, hi_x, lo_y, hi_y = a[2 * half], a[2 * half + 1], b[2 * half], b[2 * half + 1]
        for sel in (C["PAIR_01"], C["PAIR_23"]):
            lo, hi = _prmt(lo_x, lo_y, sel), _prmt(hi_x, hi_y, sel)
            out += [_prmt(lo, hi, C["PAIR_01"]), _prmt(lo, hi, C["PAIR_23"])]
    return np.stack(out, -1).view(np.uint16).reshape(len(x), 8, 2)


def _dequantize_bits(words, sb: int, g: float):
    """`dequantize`'s BF16 bits of uint32 words (8 codes each) under scale byte sb and global g."""
    rows = torch.from_numpy(words.view(np.uint8).reshape(-1, 4).copy())
    q = QTensor(rows.repeat(1, 4), torch.full((len(words), 2), sb, dtype=torch.uint8).view(torch.float8_e4m3fn),
                torch.full((len(words), 1), g, dtype=torch.float32), Format.NVFP4, torch.Size((len(words), 32)))
    return dequantize(q, torch.bfloat16).view(torch.int16).numpy().view(np.uint16)[:, :8]


# global scales: ordinary, tiny and huge (both table paths), and 0
GLOBAL_SCALES = (1.0, 3.7e-5, 0.3172, 9.1e4, 1.0e30, 2.0**-112, 2.0**-130, 3.0e36, 0.0)


def test_register_dequantization_is_dequantize_bit_for_bit():
    """The kernels' table lookup (`fp4_table_fast` / `fp4_table_exact`, `fp4_planes`,
    `dequant_word`, `dequant_word_pairs` of fp4_mma.cuh, with the header's own constants, byte
    permutes as PTX defines them)
    gives `dequantize`'s BF16 bits for every code in every position of a word, under every E4M3
    scale byte from 0 to 448 and global scales from 0 and 2**-130 to 3e36."""
    c = np.arange(256, dtype=np.uint32)
    words = c | ((c + 1) % 256 << 8) | ((c + 2) % 256 << 16) | ((c + 3) % 256 << 24)  # each byte everywhere
    other = words[::-1].copy()
    fast = slow = 0
    for g in GLOBAL_SCALES:
        g32 = np.float32(g)
        for sb in range(127):
            s = np.array([sb], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0]
            table = _table(s, g32)
            with np.errstate(over="ignore"):
                fast, slow = (fast + 1, slow) if _fast(s * g32) else (fast, slow + 1)
            want, want_other = _dequantize_bits(words, sb, g), _dequantize_bits(other, sb, g)
            assert np.array_equal(_dequant_word(words, table), want), (g, sb)
            pairs = _dequant_word_pairs(words, table, other, table)
            assert np.array_equal(pairs[..., 0], want) and np.array_equal(pairs[..., 1], want_other), (g, sb)
    assert fast > 500 and slow > 200  # both ways of building the table were checked


def test_dequantization_pairs_rows_with_their_own_tables():
    """`dequant_word_pairs` looks each row up in its own table."""
    c = np.arange(256, dtype=np.uint32)
    words = c * np.uint32(0x01010101)
    sx, sy = (np.array([b], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0] for b in (0x30, 0x51))
    pairs = _dequant_word_pairs(words, _table(sx, np.float32(0.25)), words[::-1].copy(), _table(sy, np.float32(7.0)))
    assert np.array_equal(pairs[..., 0], _dequantize_bits(words, 0x30, 0.25))
    assert np.array_equal(pairs[..., 1], _dequantize_bits(words[::-1].copy(), 0x51, 7.0))


def _exact(q, rows, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // rows[0][0].shape[1]
    for i, (k, v) in enumerate(rows):
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, -1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


@gpu
@pytest.mark.parametrize("hq, hkv, block_size, split", [(32, 4, 16, {}),
                                                        (16, 1, 32, {"min_chunk": 32, "max_splits": 4}),
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
    from 0 and 2**-9 to 448, with g spread over 2**-116 .. 2**114 (both ways `fp4_tables` builds a table)."""
    hkv, n = 4, 16 * 256
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n, hkv, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (n, hkv, 8), dtype=torch.uint8, generator=g)  # 0: an all-zero block
    gs = torch.exp2(torch.randint(-60, 40, (n, hkv, 1), generator=g).float()) * (1 + torch.rand(n, hkv, 1, generator=g))
    # s * g below 2**-120 or above 2**120 for some scales (the table's exact path), all values
    # normal BF16 (0.5 * 2**-9 * g >= 2**-126): the tensor cores' subnormals are not the question
    gs[::5] = torch.exp2(torch.randint(-116, -110, gs[::5].shape, generator=g).float())
    gs[1::5] = 2.0**113 * (1 + torch.rand(gs[1::5].shape, generator=g))
    v = {"codes": codes, "scales": scales, "g": gs}
    k = {"codes": codes.flip(0).contiguous(), "scales": scales.flip(0).contiguous(), "g": torch.full_like(gs, 2.0**-8)}
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
    want = want.repeat_interleave(8, 1)
    bad = (out != want).nonzero()
    assert not len(bad), [(tuple(i.tolist()), float(out[tuple(i)]), float(want[tuple(i)]),
                           int(scales[slot[i[0]], i[1] // 8, i[2] // 16]), float(gs[slot[i[0]], i[1] // 8, 0]))
                          for i in bad[:5]]


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
@pytest.mark.parametrize("counts, k", [([3, 0, 17, 1, 9], 384), ([0, 0, 40, 0, 0], 384), ([16, 8, 1, 0, 33], 384),
                                       ([0, 0, 0, 0, 0], 384), ([1, 0, 2, 0, 1], 1024), ([0, 5, 0, 0, 0], 2048)])
def test_cuda_grouped_gemm_is_each_experts_matmul(counts, k):
    """Experts with no rows, one n8 tile, two, and several 16-row tiles; K = 384 (three chunks,
    not split); few rows over K = 1024 and 2048 (K split across programs, partial sums added)."""
    e, n = len(counts), 96
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
@pytest.mark.parametrize("k", [384, 2048])
def test_cuda_grouped_gemm_reads_mapped_rows_in_place(k):
    """x_rows: the product of x[x_rows] (every token row used k times, in expert order), bit for
    bit, without the gather; K split (2048) or not (384)."""
    counts, tokens = [3, 0, 17, 1, 9], 12
    e, n = len(counts), 96
    experts = _experts(e, n, k, seed=k)
    args = [torch.stack([w.codes for w in experts]).cuda(), torch.stack([w.block_scales for w in experts]).cuda(),
            torch.stack([w.global_scale for w in experts]).cuda(), torch.tensor(counts).cuda()]
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    rows = torch.randint(0, tokens, (sum(counts),), generator=torch.Generator().manual_seed(3)).cuda()
    want = fp4_grouped_linear(x[rows], *args, backend="cuda")
    assert torch.equal(fp4_grouped_linear(x, *args, x_rows=rows, backend="cuda"), want)
    assert torch.equal(fp4_grouped_linear(x, *args, x_rows=rows, backend="triton"),
                       fp4_grouped_linear(x[rows], *args, backend="triton"))


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
@pytest.mark.parametrize("m", [16, 40, 64])
def test_cuda_dense_gemm_dequantizes_weights_bit_for_bit(m):
    """One-hot rows of x (one to four 16-row tiles): y^T is `dequantize`'s BF16 weights exactly,
    whatever the K split."""
    w = _experts(1, 96, 256, seed=m)[0]
    x = torch.eye(256)[:m].bfloat16()
    y = fp4_linear(x.cuda(), w.to("cuda"), backend="cuda").cpu()
    assert torch.equal(y, dequantize(w, torch.bfloat16)[:, :m].T)


@gpu
@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (5, 160, 2048), (17, 96, 768), (64, 2048, 256), (64, 5120, 2048),
                                     (41, 256, 512), (150, 160, 384)])
def test_cuda_dense_gemm_is_the_dequantized_matmul(m, n, k):
    """One to ten 16-row tiles, K split or not."""
    w = quantize(heavy_tailed(n, k, seed=m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    wd = dequantize(w, torch.bfloat16).double()
    exact, size = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    y = fp4_linear(x.cuda(), w.to("cuda"), backend="cuda").cpu()  # K split across programs where K allows
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-20 * size).all()
    assert torch.equal(fp4_linear(x.cuda(), w.to("cuda")).cpu(), y)  # "auto" takes the CUDA kernel for decode M
    # the residual added in the kernel that sums the K splits: as torch adds two BF16 tensors
    r = (torch.randn(m, n, generator=torch.Generator().manual_seed(n)) * 3).bfloat16()
    assert torch.equal(fp4_linear(x.cuda(), w.to("cuda"), residual=r.cuda(), backend="cuda").cpu(), r + y)


@gpu
@pytest.mark.parametrize("m", [1, 9, 40, 64, 100, 256])
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_dense_gemm_is_the_grouped_kernel_bit_for_bit(m, splits):
    """The dense kernel (up to 64 rows a program, shared through shared memory, the last program's
    rows and a program's last warp partly past the end) sums in the grouped kernel's order (16-row
    tiles, rows in registers): the same bits, with K split or not."""
    n, k = 160, 1024
    w = quantize(heavy_tailed(n, k, seed=m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    codes, scales, g = w.codes.cuda(), w.block_scales.view(torch.uint8).cuda(), w.global_scale.reshape(1).cuda()
    tiles = torch.tensor([[0, r0, min(m, r0 + 16)] for r0 in range(0, m, 16)], dtype=torch.int32).cuda()
    want = cuda_decode.grouped_linear(x, codes[None], scales[None], g, tiles, len(tiles), splits=splits)
    assert torch.equal(cuda_decode.dense_linear(x, codes, scales, g, splits=splits), want)


def test_fp4_linear_adds_the_residual_on_every_path():
    w = quantize(heavy_tailed(64, 128, seed=1))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    r = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    for backend in ("torch", "triton"):
        dev = "cpu" if backend == "torch" else triton_device()
        got = fp4_linear(x.to(dev), w.to(dev), residual=r.to(dev), backend=backend).cpu()
        assert torch.equal(got, r + fp4_linear(x.to(dev), w.to(dev), backend=backend).cpu()), backend
    with pytest.raises(ValueError, match=r"residual must be bfloat16 \[3, 64\]"):
        fp4_linear(x, w, residual=r.float())


def test_cuda_gemm_backend_refuses_what_it_cannot_run():
    w = quantize(torch.randn(64, 128))
    with pytest.raises(ValueError, match="backend='cuda' needs x on a GPU"):
        fp4_linear(torch.randn(2, 128).bfloat16(), w, backend="cuda")
    with pytest.raises(ValueError, match="3 splits do not divide K=256"):
        cuda_decode.grouped_linear(torch.zeros(1, 256).bfloat16(), torch.zeros(1, 32, 128, dtype=torch.uint8),
                                   torch.zeros(1, 32, 16, dtype=torch.uint8), torch.ones(1),
                                   torch.zeros(1, 3, dtype=torch.int32), 1, splits=3)
