"""FP4 decode kernels in CUDA C++, compiled at first use by NVRTC through torch
(`torch.cuda._compile_kernel`), for Hopper and newer.

- `split_attention` (fp4_decode_attention.cu): what `paged_attention._split_kernel` computes for
  an FP4 KV cache, the same partial (o, m, l) rows for the same combine kernel.
- `grouped_linear` (fp4_grouped_gemm.cu): what `linear._fp4_grouped_kernel` computes for tiles of
  up to 16 rows, for the MoE experts.
- `dense_linear` (fp4_dense_gemm.cu): the same products for a dense layer, up to 64 rows a program
  shared through shared memory, so each weight is dequantized once per 64 rows, not per 16.

All three dequantize to the same BF16 values as `dequantize`, bit for bit (a per-block table looked
up with byte permutes, fp4_mma.cuh), and build the MMA fragments in registers straight from the
loaded words: Triton stages dequantized tiles through shared memory and repacks the code bytes
one register each, which made its FP4 kernels bound by instructions
(bench/results/NOTES-decode.md). `sum_splits` adds a split-K GEMM's FP32 partial products in a
fixed order, rounds them to BF16 and adds a residual, in one kernel. The `supports_*`
functions say whether a call qualifies; the callers fall back to Triton otherwise, and always
when TRACE_CUDA_KERNELS=0 is set in the environment.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).parent
HEAD_DIM = 128
MAX_GROUP = 16
GEMM_ROWS = 16  # rows of x per GEMM tile (two n8 MMA tiles)
# __launch_bounds__ minBlocks of each kernel (caps registers at 65536 / (threads * min_blocks));
# bench/decode_kernels.py --sweep tries others.
# gemm_prefetch: K chunks a GEMM warp asks L2 for beyond the next one (in registers). The expert
# GEMMs at batch 64: fc1 114 -> 109 us, fc2 61 -> 58 (bench/results/decode_pass6_2026-12-01_h200.log);
# the grouped kernel built without it spills registers. Dense GEMMs use it when unsplit: split,
# a warp walks too few chunks to gain.
LAUNCH = {"attention_min_blocks": 12, "gemm_min_blocks": 4, "gemm_prefetch": 2, "dense_min_blocks": 3}
DENSE_ROWS = 64  # rows of x a dense GEMM program takes at most (8 n8 MMA tiles)


@functools.cache
def _nvrtc_loads() -> bool:
    """Whether torch can load NVRTC (it ships with torch's CUDA wheels). Where torch names its
    loader differently, say yes and let the compilation report what is missing."""
    utils = torch.cuda._utils
    load = getattr(utils, "_get_gpu_rtc_library", None) or getattr(utils, "_get_nvrtc_library", None)
    try:
        load and load()
    except (OSError, RuntimeError):
        return False
    return True


def available(t: torch.Tensor) -> bool:
    """Whether these kernels can run on t's device: CUDA, compute capability >= 9.0, NVRTC
    loadable, and TRACE_CUDA_KERNELS not set to 0."""
    return (t.is_cuda and os.environ.get("TRACE_CUDA_KERNELS", "1") != "0" and hasattr(torch.cuda, "_compile_kernel")
            and torch.cuda.get_device_capability(t.device) >= (9, 0) and _nvrtc_loads())


def supports_attention(q: torch.Tensor, k_cache: dict, block_size: int) -> bool:
    """Whether `split_attention` can run this call: an FP4 cache on a CUDA device of compute
    capability >= 9.0 (E4M3 pair conversion, BF16 MMA), head dim 128, <= 16 query heads per KV
    head, cache blocks a multiple of 16 tokens, and torch's NVRTC entry point present."""
    if "codes" not in k_cache or not available(q):
        return False
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache["codes"].shape[1]
    return d == HEAD_DIM and hq % hkv == 0 and hq // hkv <= MAX_GROUP and block_size % 16 == 0


def supports_gemm(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether `grouped_linear` can run y = x @ W^T with W [n, k]: x on a CUDA device of compute
    capability >= 9.0, k a multiple of 128 and n of 32."""
    return available(x) and k % 128 == 0 and n % 32 == 0


@functools.cache
def _compiled(source: str, name: str, device: int, **defines):
    """The kernel compiled for, and loaded on, one device (a module belongs to its device's context)."""
    major, minor = torch.cuda.get_device_capability(device)
    with torch.cuda.device(device):
        return torch.cuda._compile_kernel((KERNEL_DIR / source).read_text(), name, compute_capability=f"{major}{minor}",
                                          cuda_include_dirs=[str(KERNEL_DIR)],
                                          nvcc_options=[f"-D{k}={v}" for k, v in defines.items()] + ["-std=c++17"])


def _launch(source: str, name: str, like: torch.Tensor, grid, block, args, **defines) -> None:
    """Launch on like's device and its current stream (captured by a CUDA graph being recorded)."""
    device = like.device.index if like.device.index is not None else torch.cuda.current_device()
    kernel = _compiled(source, name, device, **defines)
    with torch.cuda.device(device):
        kernel(grid=grid, block=block, args=args)


def _check_contiguous(name: str, tensors) -> None:
    for i, a in enumerate(tensors):
        if not a.is_contiguous():
            raise ValueError(f"{name}: tensor argument {i} {tuple(a.shape)} is not contiguous")


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_splits(batch: int, kv_heads: int, device: torch.device, most: int) -> int:
    """How many chunks (a power of two, at most `most`) `split_attention` cuts each sequence into:
    the fewest that give about two waves of (sequence, KV head, chunk) programs at the kernel's
    occupancy. Fewer, longer chunks read the same cache but write fewer partial rows for the
    combine (batch 64, 8k context on an H200: 16 chunks, 0.163 ms against 0.169 with 32)."""
    programs = 2 * LAUNCH["attention_min_blocks"] * _multiprocessors(device)
    splits = 1
    while splits < most and batch * kv_heads * splits < programs:
        splits *= 2
    return splits


def split_attention(q, k_cache: dict, v_cache: dict, block_tables, seq_lens, part_o, part_ml, *, block_size: int,
                    scale: float, min_chunk: int, doublings: int, splits: int) -> None:
    """Fill part_o float32 [B, Hq, splits, 128] and part_ml float32 [B, Hq, splits, 2] as
    `paged_attention._split_kernel` does: chunk c of sequence b's context (`_seq_chunk`),
    unnormalised output, running max (natural-log units) and sum. q: bf16 [B, Hq, 128]; caches as
    `paged_decode_attention`; block_tables int32 [B, max_blocks], seq_lens int32 [B]. Chunks
    past a sequence's end write nothing."""
    b, hq, _ = q.shape
    hkv = k_cache["codes"].shape[1]
    args = [q, k_cache["codes"], k_cache["scales"], k_cache["g"], v_cache["codes"], v_cache["scales"], v_cache["g"],
            block_tables, seq_lens, part_o, part_ml]
    _check_contiguous("split_attention", args)
    _launch("fp4_decode_attention.cu", "fp4_decode_split", q, (b, hkv, splits), (32, 1, 1),
            args + [block_tables.shape[1], float(scale)], HQ=hq, HKV=hkv, G=hq // hkv, BS=block_size,
            MIN_CHUNK=min_chunk, DOUBLINGS=doublings, SPLITS=splits, MIN_BLOCKS=LAUNCH["attention_min_blocks"])


def _check_gemm(name: str, m: int, n: int, k: int, splits: int, residual: torch.Tensor | None) -> None:
    if splits < 1 or (k // 128) % splits:
        raise ValueError(f"{name}: {splits} splits do not divide K={k} into 128-wide chunks")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != torch.bfloat16):
        raise ValueError(f"{name}: residual must be bfloat16 [{m}, {n}], got {residual.dtype} {tuple(residual.shape)}")


def sum_splits(part: torch.Tensor, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N]: a split-K GEMM's FP32 partial products part [S, M, N] added in split order
    (no atomics) and rounded to BF16 once, plus `residual` (bf16 [M, N], added in FP32 and
    rounded again: torch's BF16 add), in one kernel. out: where to write it (else new)."""
    if part.dim() != 3 or part.dtype != torch.float32:
        raise ValueError(f"sum_splits: part must be float32 [S, M, N], got {part.dtype} {tuple(part.shape)}")
    splits, m, n = part.shape
    _check_gemm("sum_splits", m, n, 128, 1, residual)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=part.device) if out is None else out
    _check_contiguous("sum_splits", [part, y])
    if m * n:
        res = residual.contiguous() if residual is not None else y
        _launch("fp4_grouped_gemm.cu", "sum_splits", part, ((m * n + 255) // 256, 1, 1), (256, 1, 1),
                [part, res, y, m * n, splits, int(residual is not None)])
    return y


def _finish(y, part, splits: int, residual: torch.Tensor | None, keep_parts: bool = False) -> torch.Tensor:
    """What a GEMM wrapper returns from its kernel's output: y, plus the residual (a BF16 add by
    torch when K was not split); or, split, the partial products summed by `sum_splits`, or
    left as they are with `keep_parts` (for a consumer that sums them itself)."""
    if splits == 1:
        return y if residual is None else residual + y
    return part if keep_parts else sum_splits(part, residual, out=y)


def grouped_linear(x, codes, scales, g, tiles, num_tiles: int, out: torch.Tensor | None = None,
                   splits: int = 1, residual: torch.Tensor | None = None,
                   x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] bf16 with y[rows of e] = x[rows of e] @ dequantize(W_e)^T. x: bf16 [M, K];
    codes uint8 [E, N, K/2]; scales uint8 (E4M3 bits) [E, N, K/16]; g float32 [E]; tiles int32
    [num_tiles, 3]: (expert, first row, end row) of up to GEMM_ROWS rows each, empty ones (no
    rows) allowed, as `linear._tile_list_kernel` lists them. out: where to write y (else new).
    splits: K split across programs (a power of two dividing K / 128); the FP32 partial products
    are summed in split order, then rounded to BF16 once. residual: bf16 [M, N] added to y (in
    FP32, rounded again: torch's BF16 add), in the split-sum kernel when splits > 1. x_rows:
    int64 [M] on x's device, row r of the product is row x_rows[r] of x (then x may have any
    number of rows): what x[x_rows] would give, without writing it."""
    k = x.shape[1]
    m = x.shape[0] if x_rows is None else x_rows.numel()
    n = codes.shape[1]
    _check_gemm("grouped_linear", m, n, k, splits, residual)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device) if out is None else out
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    if x_rows is not None and (x_rows.dtype != torch.int64 or x_rows.device != x.device):
        raise ValueError(f"grouped_linear: x_rows must be int64 on {x.device}, got {x_rows.dtype} on {x_rows.device}")
    args = [x, codes, scales, g, tiles, tiles if x_rows is None else x_rows, y, part]
    _check_contiguous("grouped_linear", args)
    if not (m and num_tiles):
        return y if residual is None else residual + y
    _launch("fp4_grouped_gemm.cu", "fp4_grouped_gemm", x, (num_tiles, (n + 127) // 128, splits), (128, 1, 1),
            args + [m, n, k, splits, int(x_rows is not None)], MIN_BLOCKS=LAUNCH["gemm_min_blocks"],
            PREFETCH=LAUNCH["gemm_prefetch"])
    return _finish(y, part, splits, residual)


def dense_rows(m: int) -> int:
    """Rows of x a `dense_linear` program takes: all m up to DENSE_ROWS (whole n8 MMA tiles)."""
    return min(DENSE_ROWS, -(-m // 8) * 8)


def dense_linear(x, codes, scales, g, out: torch.Tensor | None = None, splits: int = 1,
                 residual: torch.Tensor | None = None, keep_parts: bool = False) -> torch.Tensor:
    """y [M, N] bf16 = x @ dequantize(W)^T for a dense weight: x bf16 [M, K]; codes uint8 [N, K/2];
    scales uint8 (E4M3 bits) [N, K/16]; g float32 [1]. Each weight element is dequantized once per
    `dense_rows(M)` rows (fp4_dense_gemm.cu), with the grouped kernel's summation order: the
    same bits as `grouped_linear` for the same splits. out, splits, residual: as `grouped_linear`.
    keep_parts (no residual): with splits > 1, return the FP32 partial products [splits, M, N]
    unsummed, for a consumer kernel that sums them as `sum_splits` does (one launch fewer)."""
    m, k = x.shape
    n = codes.shape[0]
    _check_gemm("dense_linear", m, n, k, splits, residual)
    if keep_parts and residual is not None:
        raise ValueError("dense_linear: keep_parts leaves the residual to the consumer; pass none")
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device) if out is None else out
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    args = [x, codes, scales, g, y, part]
    _check_contiguous("dense_linear", args)
    if not m:
        return part if keep_parts and splits > 1 else (y if residual is None else residual + y)
    rows = dense_rows(m)
    _launch("fp4_dense_gemm.cu", "fp4_dense_gemm", x, ((m + rows - 1) // rows, (n + 63) // 64, splits), (128, 1, 1),
            args + [m, n, k, splits], NT=rows // 8, MIN_BLOCKS=LAUNCH["dense_min_blocks"],
            PREFETCH=LAUNCH["gemm_prefetch"] if splits == 1 else 0)
    return _finish(y, part, splits, residual, keep_parts)
