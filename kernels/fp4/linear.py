"""y = x @ W^T with W held as tensor-scaled NVFP4 and dequantized inside the GEMM.

Hopper has no FP4 tensor cores, so the speed of FP4 weights comes from bytes: a decode step
reads 4.5 bits per weight instead of 16. The Triton kernel loads packed codes and E4M3 block
scales, dequantizes each [BLOCK_N, BLOCK_K] tile exactly as `dequantize` does ((e2m1 * s) * g,
rounded to BF16), and multiplies on the tensor cores with FP32 accumulation. The torch path
(CPU, or backend="torch") dequantizes the whole weight, then matmuls.

Shapes: x [M, K] bf16, W [N, K] (codes uint8 [N, K/2], scales e4m3 [N, K/16], g 0-d), y [M, N].
"""

from __future__ import annotations

import torch

from .api import _use_triton, dequantize
from .formats import Format
from .qtensor import QTensor

try:
    import triton
    import triton.language as tl

    from .triton_fp4 import _bf16_rne, _e2m1_value, _e4m3_value, _interpreting
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None


def fp4_linear(x: torch.Tensor, w: QTensor, *, backend: str = "auto") -> torch.Tensor:
    """x [M, K] bfloat16 @ dequantize(w)^T -> [M, N] bfloat16 (w: NVFP4 [N, K], one global scale).

    Raises ValueError for another format, a row-scaled weight, or shapes that do not fit.
    """
    if w.fmt is not Format.NVFP4 or w.is_row_scaled or len(w.shape) != 2:
        raise ValueError("fp4_linear needs a 2-D tensor-scaled NVFP4 weight")
    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.bfloat16:
        raise ValueError(f"fp4_linear: x must be bfloat16 [M, {w.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    if not _use_triton(x, backend):
        return x @ dequantize(w, torch.bfloat16, backend="torch").T
    return _fp4_linear_triton(x.contiguous(), w)


def fp4_grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor,
                       counts: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] consecutive rows for expert e) times each expert's
    FP4 weight: y[rows of e] = x[rows of e] @ dequantize(W_e)^T.

    Args:
        x: bfloat16 [M, K]. codes: uint8 [E, N, K/2]; scales: float8_e4m3fn [E, N, K/16];
            g: float32 [E], one global scale per expert. counts: int64 [E] summing to M, on x's
            device (the Triton path builds its tile list there, without a host synchronisation).
    Returns:
        bfloat16 [M, N].
    """
    e, n, half_k = codes.shape
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != 2 * half_k or x.dtype != torch.bfloat16 or tuple(counts.shape) != (e,):
        raise ValueError(f"fp4_grouped_linear: x {x.dtype} {tuple(x.shape)} and counts {tuple(counts.shape)} "
                         f"do not fit weights {tuple(codes.shape)}")
    if not _use_triton(x, backend):
        sizes = counts.tolist()
        if sum(sizes) != m:
            raise ValueError(f"fp4_grouped_linear: counts sum to {sum(sizes)}, x has {m} rows")
        y = x.new_empty(m, n)
        start = 0
        for i, c in enumerate(sizes):
            if c:
                w = QTensor(codes[i], scales[i], g[i], Format.NVFP4, torch.Size((n, 2 * half_k)))
                y[start:start + c] = x[start:start + c] @ dequantize(w, torch.bfloat16, backend="torch").T
            start += c
        return y
    k = x.shape[1]
    block_m = 16 if m <= 16 * e else 64
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    # Tiles of at most block_m rows of one expert, listed on the device: tile t belongs to the
    # expert whose cumulative tile count first exceeds t; tiles past the last are empty.
    counts = counts.to(x.device, torch.int64)
    row_end = counts.cumsum(0)
    row_start = row_end - counts
    n_tiles = (counts + block_m - 1) // block_m
    tile_end = n_tiles.cumsum(0)
    max_tiles = triton.cdiv(m, block_m) + e
    t = torch.arange(max_tiles, device=x.device)
    expert = torch.searchsorted(tile_end, t, right=True).clamp(max=e - 1)
    r0 = row_start[expert] + (t - (tile_end - n_tiles)[expert]) * block_m
    r1 = torch.minimum(r0 + block_m, row_end[expert])
    r1 = torch.where(t < tile_end[-1], r1, r0)  # past the last tile: no rows
    tile_info = torch.stack([expert, r0, r1], 1).to(torch.int32).contiguous()
    block_n, block_k = 64, 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32 if k % 32 == 0 else 16
    _fp4_grouped_kernel[(max_tiles, triton.cdiv(n, block_n))](
        x.contiguous(), codes, scales.view(torch.uint8), g.float().contiguous(), tile_info, y, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRET=_interpreting(),
        num_warps=4, enable_fp_fusion=False,
    )
    return y


def _fp4_linear_triton(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32 if k % 32 == 0 else 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp4_linear_kernel[grid](
        x, w.codes, w.block_scales.view(torch.uint8), w.global_scale.reshape(1).float(), y, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRET=_interpreting(),
        num_warps=4, enable_fp_fusion=False,
    )
    return y


if triton is not None:

    # K is a compile-time constant (a model dimension): Triton 3.6's interpreter cannot loop to a
    # runtime bound inside a nested jit function.
    @triton.jit
    def _fp4_tile_product(acc, x_ptr, codes_ptr, scales_ptr, g, rm, m_ok, rn, n_ok, K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        """acc += x[rm, :] @ dequantize(W[rn, :])^T, W's codes/scales at the given pointers."""
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=m_ok[:, None], other=0.0)
            rkh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(codes_ptr + rn[:, None].to(tl.int64) * (K // 2) + rkh[None, :], mask=n_ok[:, None],
                             other=0)
            codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, BLOCK_K]).to(tl.int32)
            val = (_e2m1_value(codes & 7).to(tl.int32, bitcast=True) | ((codes & 8) << 28)).to(tl.float32,
                                                                                               bitcast=True)
            rb = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            sb = tl.load(scales_ptr + rn[:, None].to(tl.int64) * (K // 16) + rb[None, :], mask=n_ok[:, None],
                         other=0).to(tl.int32)
            s = tl.reshape(tl.broadcast_to(_e4m3_value(sb)[:, :, None], [BLOCK_N, BLOCK_K // 16, 16]),
                           [BLOCK_N, BLOCK_K])
            w = (val * s) * g
            if INTERPRET:  # the interpreter's bf16 dot is unreliable; bf16 -> fp32 is exact
                acc += tl.dot(x.to(tl.float32), tl.trans(_bf16_rne(w).to(tl.float32)))
            else:
                acc += tl.dot(x, tl.trans(w.to(tl.bfloat16)))
        return acc

    @triton.jit
    def _fp4_linear_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, y_ptr, M, N, K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           INTERPRET: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _fp4_tile_product(acc, x_ptr, codes_ptr, scales_ptr, tl.load(g_ptr), rm, m_ok, rn, n_ok, K,
                                BLOCK_N, BLOCK_K, INTERPRET)
        y = _bf16_rne(acc) if INTERPRET else acc.to(tl.bfloat16)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _fp4_grouped_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, tiles_ptr, y_ptr, N, K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            INTERPRET: tl.constexpr):
        tile, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(tiles_ptr + tile * 3).to(tl.int64)
        row0, row1 = tl.load(tiles_ptr + tile * 3 + 1), tl.load(tiles_ptr + tile * 3 + 2)
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < row1, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _fp4_tile_product(acc, x_ptr, codes_ptr + expert * N * (K // 2), scales_ptr + expert * N * (K // 16),
                                tl.load(g_ptr + expert), rm, m_ok, rn, n_ok, K, BLOCK_N, BLOCK_K, INTERPRET)
        y = _bf16_rne(acc) if INTERPRET else acc.to(tl.bfloat16)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])
