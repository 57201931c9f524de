"""y = x @ W^T with W held as tensor-scaled NVFP4 and dequantized inside the GEMM.

Hopper has no FP4 tensor cores, so the speed of FP4 weights comes from bytes: a decode step
reads 4.5 bits per weight instead of 16. The Triton kernel loads packed codes and E4M3 block
scales, dequantizes each [BLOCK_N, BLOCK_K] tile exactly as `dequantize` does ((e2m1 * s) * g,
rounded to BF16), and multiplies on the tensor cores with FP32 accumulation. On Hopper,
decode-sized GEMMs run CUDA kernels instead (`cuda_decode.grouped_linear` for the experts,
`cuda_decode.dense_linear` for dense layers): the same values, the MMA fragments built in
registers. The torch path (CPU, or backend="torch") dequantizes the whole weight, then matmuls.
backend: "auto", "torch", "triton" or "cuda" (which raises where it does not apply).

Shapes: x [M, K] bf16, W [N, K] (codes uint8 [N, K/2], scales e4m3 [N, K/16], g 0-d), y [M, N].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import cuda_decode
from .api import _use_triton, dequantize
from .formats import Format
from .qtensor import QTensor

try:
    import triton
    import triton.language as tl

    from .triton_fp4 import _bf16_rne, _dequant_halves, _interpreting
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None


def fp4_linear(x: torch.Tensor, w: QTensor, *, residual: torch.Tensor | None = None,
               backend: str = "auto") -> torch.Tensor:
    """x [M, K] bfloat16 @ dequantize(w)^T -> [M, N] bfloat16 (w: NVFP4 [N, K], one global scale);
    with `residual` (bfloat16 [M, N]), residual + that product as torch adds two BF16 tensors (on
    the CUDA path within the kernel that sums the K splits).

    Raises ValueError for another format, a row-scaled weight, or shapes that do not fit.
    """
    parts = fp4_linear_parts(x, w, backend=backend)
    if residual is not None and (residual.shape != parts.shape[-2:] or residual.dtype != torch.bfloat16):
        raise ValueError(f"fp4_linear: residual must be bfloat16 {list(parts.shape[-2:])}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    return sum_parts(parts, residual)


def fp4_linear_parts(x: torch.Tensor, w: QTensor, *, backend: str = "auto") -> torch.Tensor:
    """`fp4_linear(x, w)` as its GPU kernel leaves it: where the GEMM splits K across programs,
    the FP32 partial products float32 [S, M, N] (S >= 2), for a consumer kernel to add in split
    order as `sum_parts` does, saving the launch that would sum them; else the product bfloat16
    [M, N]. x, w and the errors: as `fp4_linear`."""
    if w.fmt is not Format.NVFP4 or w.is_row_scaled or len(w.shape) != 2:
        raise ValueError("fp4_linear needs a 2-D tensor-scaled NVFP4 weight")
    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.bfloat16:
        raise ValueError(f"fp4_linear: x must be bfloat16 [M, {w.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if _use_cuda(x, n, k, m <= DENSE_CUDA_ROWS, backend):  # each weight dequantized once per 64 rows
        programs = triton.cdiv(m, cuda_decode.dense_rows(m)) * triton.cdiv(n, 64)
        return cuda_decode.dense_linear(x.contiguous(), w.codes, w.block_scales.view(torch.uint8),
                                        w.global_scale.reshape(1).float(),
                                        splits=_k_splits(programs, k // 128, x.device, per_sm=DENSE_PROGRAMS_PER_SM,
                                                         min_steps=DENSE_MIN_CHUNKS), keep_parts=True)
    if _use_triton(x, backend) and not (backend == "auto" and m >= DEQUANT_GEMM_ROWS):
        return _fp4_linear_triton(x.contiguous(), w)
    # the whole weight dequantized once (the kernels' BF16 values), then a plain matmul: the torch
    # path, and on a GPU prefill sizes, where cuBLAS beats rebuilding each weight tile per 64 rows
    return x @ dequantize(w, torch.bfloat16, backend="torch" if backend == "torch" else "auto").T


def sum_parts(parts: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """A product as `fp4_linear_parts` returns it, made whole: FP32 partial products [S, *shape]
    added in split order (parts[0] + parts[1] + ...) and rounded to BF16 once; a bf16 [*shape]
    product as it is. Plus `residual` (bf16 [*shape]) as torch adds two BF16 tensors. One kernel
    on a GPU that runs the CUDA decode kernels (`cuda_decode.sum_splits`)."""
    if parts.dtype == torch.bfloat16:
        return parts if residual is None else residual + parts
    if parts.dtype != torch.float32 or parts.dim() < 2:
        raise ValueError(f"sum_parts: parts must be bfloat16 [...] or float32 [S, ...], got {parts.dtype} "
                         f"{tuple(parts.shape)}")
    if cuda_decode.available(parts):
        flat = parts.reshape(parts.shape[0], -1, parts.shape[-1])
        res = None if residual is None else residual.reshape(flat.shape[1:])
        return cuda_decode.sum_splits(flat, res).view(parts.shape[1:])
    acc = parts[0].clone()
    for z in range(1, parts.shape[0]):
        acc += parts[z]
    y = acc.bfloat16()
    return y if residual is None else residual + y


# Prefill-sized GEMMs on a GPU (backend "auto"): from this many rows (dense) or this many rows per
# expert on average (grouped), the weight is dequantized once to the BF16 values the kernels build
# per tile and cuBLAS multiplies: Hopper has no FP4 MMA, and the Triton kernels rebuild each weight
# tile once per 64 rows (bench/prefill_kernels.py measures both).
DEQUANT_GEMM_ROWS = 1024
DEQUANT_EXPERT_ROWS = 128

# Dense FP4 GEMMs of up to this many rows (decode batches) run the CUDA kernel where it applies,
# K split until there are about DENSE_PROGRAMS_PER_SM programs (4 warps each) per multiprocessor
# (bench/results/decode_pass6_2026-12-01_h200.log); the MoE GEMMs of few rows split until
# CUDA_PROGRAMS_PER_SM.
DENSE_CUDA_ROWS = 256
CUDA_PROGRAMS_PER_SM = 4
DENSE_PROGRAMS_PER_SM = 2
DENSE_MIN_CHUNKS = 4  # K chunks of 128 a dense split keeps at least (proj at batch 64: 8 splits, not 16)


def _use_cuda(x: torch.Tensor, n: int, k: int, small: bool, backend: str) -> bool:
    """backend "auto": the CUDA C++ kernel (cuda_decode) when it applies to x [M, k] @ W^T [k, n]
    and M is decode-sized (`small`), else Triton; "cuda": it, or a ValueError saying why not."""
    ok = backend in ("auto", "cuda") and small and cuda_decode.supports_gemm(x, n, k)
    if backend == "cuda" and not ok:
        raise ValueError(f"backend='cuda' needs x on a GPU of compute capability >= 9.0, K a multiple of 128, N of "
                         f"32 and decode-sized M (got x {tuple(x.shape)} on {x.device}, N={n}, K={k})")
    return ok


class ExpertTiles(NamedTuple):
    """Row tiles of the GPU grouped GEMM: info int32 [count, 3] of (expert, first row, end row),
    empty past the last, for `rows` rows grouped by one counts tensor."""

    info: torch.Tensor
    count: int
    rows: int


def expert_tile_shape(m: int, e: int) -> tuple[int, int]:
    """(rows per tile, tiles listed) of the grouped GEMM's tile list for m rows over e experts:
    16-row tiles at decode sizes, else 64; at most one partial tile per expert."""
    block_m = cuda_decode.GEMM_ROWS if m <= cuda_decode.GEMM_ROWS * e else 64
    return block_m, -(-m // block_m) + e


def expert_tiles(counts: torch.Tensor, m: int) -> ExpertTiles:
    """The row tiles the GPU grouped GEMM runs for m rows grouped by expert (counts int64 [E] on
    the GPU), listed by one small kernel without a host synchronisation. Layers whose two grouped
    GEMMs share the rows and counts (fc1, fc2) build them once and pass them to both."""
    e = counts.numel()
    block_m, max_tiles = expert_tile_shape(m, e)
    tile_info = torch.empty((max_tiles, 3), dtype=torch.int32, device=counts.device)
    _tile_list_kernel[(triton.cdiv(max_tiles, 32),)](
        counts, tile_info, e, max_tiles, BLOCK_M=block_m, E_PAD=triton.next_power_of_2(e), T_BLOCK=32,
    )
    return ExpertTiles(tile_info, max_tiles, m)


def fp4_grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor,
                       counts: torch.Tensor, *, tiles: ExpertTiles | None = None,
                       x_rows: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] consecutive rows for expert e) times each expert's
    FP4 weight: y[rows of e] = x[rows of e] @ dequantize(W_e)^T. On a GPU, decode sizes run the
    CUDA kernel, prefill sizes (`DEQUANT_EXPERT_ROWS` rows per expert on average) every expert
    dequantized once and torch's grouped GEMM, the rest the Triton kernel.

    Args:
        x: bfloat16 [M, K]. codes: uint8 [E, N, K/2]; scales: float8_e4m3fn [E, N, K/16];
            g: float32 [E], one global scale per expert. counts: int64 [E] summing to M, on x's
            device (the GPU paths build their tile list there, without a host synchronisation).
        tiles: `expert_tiles(counts, M)` of these counts when the caller has it already (GPU paths).
        x_rows: int64 [M]: the rows are x[x_rows] (x then [T, K], any T): the CUDA kernel reads
            them where they are, the other paths gather them first.
    Returns:
        bfloat16 [M, N].
    """
    e, n, half_k = codes.shape
    if x.dim() != 2 or x.shape[1] != 2 * half_k or x.dtype != torch.bfloat16 or tuple(counts.shape) != (e,):
        raise ValueError(f"fp4_grouped_linear: x {x.dtype} {tuple(x.shape)} and counts {tuple(counts.shape)} "
                         f"do not fit weights {tuple(codes.shape)}")
    if x_rows is not None and (x_rows.dim() != 1 or x_rows.dtype != torch.int64):
        raise ValueError(f"fp4_grouped_linear: x_rows must be int64 [M], got {x_rows.dtype} {tuple(x_rows.shape)}")
    m = x.shape[0] if x_rows is None else x_rows.numel()
    use_cuda = _use_cuda(x, n, 2 * half_k, m <= cuda_decode.GEMM_ROWS * e, backend)
    if x_rows is not None and not use_cuda:
        x, x_rows = x[x_rows], None
    if backend == "auto" and x.is_cuda and not use_cuda and m >= DEQUANT_EXPERT_ROWS * e:
        return _dequantized_grouped_mm(x, codes, scales, g, counts)
    if not use_cuda and not _use_triton(x, backend):
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
    block_m, max_tiles = expert_tile_shape(m, e)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    if tiles is not None and (tiles.rows != m or tiles.count != max_tiles):
        raise ValueError(f"fp4_grouped_linear: tiles of {tiles.rows} rows were not listed for {m} rows of {e} experts "
                         "(expert_tiles(counts, M))")
    tile_info, max_tiles, _ = expert_tiles(counts.to(x.device), m) if tiles is None else tiles
    if use_cuda:
        # at most one tile per expert with rows plus one per GEMM_ROWS rows hold rows: with few of
        # them, each program would walk all of K one DRAM latency at a time, so K is split (as for
        # dense layers; a decode step of one sequence runs 8 tiles)
        busy = min(e, m) + triton.cdiv(m, cuda_decode.GEMM_ROWS)
        splits = _k_splits(busy * triton.cdiv(n, 128), k // 128, x.device, per_sm=CUDA_PROGRAMS_PER_SM)
        return cuda_decode.grouped_linear(x.contiguous(), codes, scales.view(torch.uint8), g.float().contiguous(),
                                          tile_info, max_tiles, out=y, splits=splits, x_rows=x_rows)
    block_n, block_k = TILE["block_n"], _block_k(k)
    _fp4_grouped_kernel[(max_tiles, triton.cdiv(n, block_n))](
        x.contiguous(), codes, scales.view(torch.uint8), g.float().contiguous(), tile_info, y, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRET=_interpreting(),
        num_warps=TILE["num_warps"], enable_fp_fusion=False,
    )
    return y


def _dequantized_grouped_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor,
                            counts: torch.Tensor) -> torch.Tensor:
    """`fp4_grouped_linear` at prefill sizes: every expert's weight dequantized in one launch
    (bf16 [E, N, K], a transient of 2 bytes per weight), then torch's grouped GEMM; no host sync."""
    e, n, half_k = codes.shape
    rows = QTensor(codes, scales, g.float().reshape(e, 1, 1).expand(e, n, 1), Format.NVFP4,
                   torch.Size((e, n, 2 * half_k)))  # row-scaled view: each expert's rows share its g
    w = dequantize(rows, torch.bfloat16)
    return torch._grouped_mm(x.contiguous(), w.transpose(1, 2), offs=counts.to(x.device).cumsum(0).to(torch.int32))


# Launch shape of the FP4 GEMMs for decode-sized M (bench/decode_kernels.py --sweep measures others).
# "programs": split K across programs until a dense GEMM has about this many per multiprocessor.
TILE = {"block_n": 128, "block_k": 128, "num_warps": 4, "programs": 8}


def _block_k(k: int) -> int:
    """K per loop step: the largest power of two from TILE["block_k"] down to 32 dividing k, else
    32 with the tail masked (tl.dot needs 16 packed columns)."""
    sizes = [b for b in (512, 256, 128, 64, 32) if b <= TILE["block_k"]]
    return next((b for b in sizes if k % b == 0), 32)


def _k_splits(programs: int, k_steps: int, device: torch.device, per_sm: int | None = None,
              min_steps: int = 1) -> int:
    """K splits (a power of two dividing k_steps) that bring `programs` up to per_sm (default
    TILE["programs"]) per multiprocessor (the interpreter counts one multiprocessor, so CPU tests
    split too), each split keeping at least min_steps of the k_steps. A decode GEMM has few output
    tiles; unsplit, each program walks all of K one latency at a time; split finely, the FP32
    partial products to sum grow with the splits."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    per_sm = TILE["programs"] if per_sm is None else per_sm
    splits = 1
    while programs * splits < per_sm * sms and k_steps % (2 * splits) == 0 and k_steps // (2 * splits) >= min_steps:
        splits *= 2
    return splits


def _fp4_linear_triton(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x @ dequantize(w)^T by the Triton kernel: bf16 [M, N], or float32 [S, M, N] partial
    products where K is split (`fp4_linear_parts`)."""
    m, k = x.shape
    n = w.shape[0]
    block_m = 16 if m <= 64 else 64  # decode batches: more programs, the weight tiles re-read from L2
    block_n, block_k = TILE["block_n"], _block_k(k)
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = _k_splits(grid_mn, triton.cdiv(k, block_k), x.device)
    # Split K: FP32 partial products summed in a fixed order (deterministic), then one rounding
    out = torch.empty((splits, m, n), dtype=torch.float32 if splits > 1 else torch.bfloat16, device=x.device)
    _fp4_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        x, w.codes, w.block_scales.view(torch.uint8), w.global_scale.reshape(1).float(), out, m, n, k,
        K_SPLIT=triton.cdiv(k, block_k) // splits * block_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRET=_interpreting(), num_warps=TILE["num_warps"], enable_fp_fusion=False,
    )
    return out[0] if splits == 1 else out


if triton is not None:

    @triton.jit
    def _fp4_tile_product(acc, x_ptr, codes_ptr, scales_ptr, g, rm, m_ok, rn, n_ok, k_begin, K: tl.constexpr,
                          K_LEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          INTERPRET: tl.constexpr):
        """acc[BLOCK_N, BLOCK_M] += dequantize(W[rn, k]) @ x[rm, k]^T over k in
        [k_begin, k_begin + K_LEN): the output transposed, so that the wide weight tile is the
        MMA's left operand and the few x rows its right one.

        The even and odd columns of K are two products (W_even x_even^T + W_odd x_odd^T), so a
        packed byte's two codes never have to be interleaved in registers. The loads are left to
        Triton's software pipeline (cp.async through shared memory): a hand-written prefetch into
        registers defeated it and unpacked every code byte into its own register.
        """
        for kk in range(0, K_LEN, BLOCK_K):
            jh = (k_begin + kk) // 2 + tl.arange(0, BLOCK_K // 2)  # packed byte columns: elements 2j, 2j + 1
            k_ok = jh < K // 2  # K is a multiple of 16, not always of BLOCK_K
            packed = tl.load(codes_ptr + rn[:, None].to(tl.int64) * (K // 2) + jh[None, :],
                             mask=n_ok[:, None] & k_ok[None, :], other=0)
            rb = (k_begin + kk) // 16 + tl.arange(0, BLOCK_K // 16)
            sb = tl.load(scales_ptr + rn[:, None].to(tl.int64) * (K // 16) + rb[None, :],
                         mask=n_ok[:, None] & (rb < K // 16)[None, :], other=0)
            x_cols = x_ptr + rm[None, :].to(tl.int64) * K + 2 * jh[:, None]  # x^T halves [BLOCK_K/2, BLOCK_M]
            x_even = tl.load(x_cols, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            x_odd = tl.load(x_cols + 1, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            sb = tl.reshape(tl.broadcast_to(sb[:, :, None], [BLOCK_N, BLOCK_K // 16, 8]), [BLOCK_N, BLOCK_K // 2])
            w_even, w_odd = _dequant_halves(packed, sb, g, INTERPRET)
            if INTERPRET:  # the interpreter's bf16 dot is unreliable; bf16 -> fp32 is exact
                acc += tl.dot(w_even.to(tl.float32), x_even.to(tl.float32))
                acc += tl.dot(w_odd.to(tl.float32), x_odd.to(tl.float32))
            else:
                acc += tl.dot(w_even, x_even)
                acc += tl.dot(w_odd, x_odd)
        return acc

    @triton.jit
    def _tile_list_kernel(counts_ptr, tiles_ptr, E, MAX_TILES, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                          T_BLOCK: tl.constexpr):
        """(expert, first row, end row) int32 of T_BLOCK tiles: tile t is the (t - first tile of
        e)-th block of BLOCK_M rows of the expert e whose tiles [first, end) contain t, rows
        sorted by expert with counts[e] each; (0, 0, 0) past the last tile."""
        e = tl.arange(0, E_PAD)
        c = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
        row_end = tl.cumsum(c, 0)
        n_tiles = (c + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(n_tiles, 0)
        tile_start = tile_end - n_tiles
        t = tl.program_id(0) * T_BLOCK + tl.arange(0, T_BLOCK)
        hit = (tile_start[None, :] <= t[:, None]) & (t[:, None] < tile_end[None, :])  # [T, E], one per row at most
        expert = tl.sum(tl.where(hit, e[None, :], 0), 1)
        r0 = tl.sum(tl.where(hit, row_end[None, :] - c[None, :] + (t[:, None] - tile_start[None, :]) * BLOCK_M, 0), 1)
        r1 = tl.minimum(r0 + BLOCK_M, tl.sum(tl.where(hit, row_end[None, :], 0), 1))
        ok = t < MAX_TILES
        tl.store(tiles_ptr + t * 3, expert, mask=ok)
        tl.store(tiles_ptr + t * 3 + 1, r0, mask=ok)
        tl.store(tiles_ptr + t * 3 + 2, r1, mask=ok)

    @triton.jit
    def _store_transposed(y_ptr, acc, rm, m_ok, rn, n_ok, N, INTERPRET: tl.constexpr):
        """y[rm, rn] = acc[rn, rm] in y's dtype (FP32 partials or BF16)."""
        if y_ptr.dtype.element_ty == tl.float32:
            y = acc
        elif INTERPRET:
            y = _bf16_rne(acc)
        else:
            y = acc.to(tl.bfloat16)
        tl.store(y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], y, mask=m_ok[None, :] & n_ok[:, None])

    @triton.jit
    def _fp4_linear_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, y_ptr, M, N, K: tl.constexpr, K_SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           INTERPRET: tl.constexpr):
        """Output tile (pid_m, pid_n) over K split pid_k (y_ptr: [splits, M, N])."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc = _fp4_tile_product(acc, x_ptr, codes_ptr, scales_ptr, tl.load(g_ptr), rm, m_ok, rn, n_ok,
                                pid_k * K_SPLIT, K, K_SPLIT, BLOCK_N, BLOCK_K, INTERPRET)
        _store_transposed(y_ptr + pid_k.to(tl.int64) * M * N, acc, rm, m_ok, rn, n_ok, N, INTERPRET)

    @triton.jit
    def _fp4_grouped_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, tiles_ptr, y_ptr, N, K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            INTERPRET: tl.constexpr):
        tile, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(tiles_ptr + tile * 3).to(tl.int64)
        row0, row1 = tl.load(tiles_ptr + tile * 3 + 1), tl.load(tiles_ptr + tile * 3 + 2)
        if row1 <= row0:  # a tile past the last one: no rows, so no weights to read
            return
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < row1, rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc = _fp4_tile_product(acc, x_ptr, codes_ptr + expert * N * (K // 2), scales_ptr + expert * N * (K // 16),
                                tl.load(g_ptr + expert), rm, m_ok, rn, n_ok, 0, K, K, BLOCK_N, BLOCK_K, INTERPRET)
        _store_transposed(y_ptr, acc, rm, m_ok, rn, n_ok, N, INTERPRET)
