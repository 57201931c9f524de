"""FP4 decode kernels in CUDA C++, compiled at first use by NVRTC through torch
(`torch.cuda._compile_kernel`), for Hopper and newer.

- `split_attention` (fp4_decode_attention.cu): what `paged_attention._split_kernel` computes for
  an FP4 KV cache, the same partial (o, m, l) rows for the same combine kernel.
- `grouped_linear` (fp4_grouped_gemm.cu): what `linear._fp4_grouped_kernel` computes for tiles of
  up to 16 rows, for the MoE experts and (one expert) dense layers.

Both dequantize to the same BF16 values as `dequantize`, bit for bit (`dequant_word` in
fp4_mma.cuh), and build the MMA fragments in registers straight from the loaded words: Triton
stages dequantized tiles through shared memory and repacks the code bytes one register each,
which made its FP4 kernels bound by instructions (bench/results/NOTES-decode.md). The `supports_*`
functions say whether a call qualifies; the callers fall back to Triton otherwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).parent
HEAD_DIM = 128
MAX_GROUP = 16
GEMM_ROWS = 16  # rows of x per GEMM tile (two n8 MMA tiles)
# __launch_bounds__ minBlocks of each kernel (caps registers at 65536 / (threads * min_blocks));
# bench/decode_kernels.py --sweep tries others.
LAUNCH = {"attention_min_blocks": 12, "gemm_min_blocks": 4}


def _runtime_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and hasattr(torch.cuda, "_compile_kernel") and torch.cuda.get_device_capability(t.device) >= (9, 0)


def supports_attention(q: torch.Tensor, k_cache: dict, block_size: int) -> bool:
    """Whether `split_attention` can run this call: an FP4 cache on a CUDA device of compute
    capability >= 9.0 (E4M3 pair conversion, BF16 MMA), head dim 128, <= 16 query heads per KV
    head, cache blocks a multiple of 16 tokens, and torch's NVRTC entry point present."""
    if "codes" not in k_cache or not _runtime_ok(q):
        return False
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache["codes"].shape[1]
    return d == HEAD_DIM and hq % hkv == 0 and hq // hkv <= MAX_GROUP and block_size % 16 == 0


def supports_gemm(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether `grouped_linear` can run y = x @ W^T with W [n, k]: x on a CUDA device of compute
    capability >= 9.0, k a multiple of 128 and n of 32."""
    return _runtime_ok(x) and k % 128 == 0 and n % 32 == 0


@functools.lru_cache(maxsize=None)
def _kernel(source: str, name: str, capability: str, **defines):
    return torch.cuda._compile_kernel((KERNEL_DIR / source).read_text(), name, compute_capability=capability,
                                      cuda_include_dirs=[str(KERNEL_DIR)],
                                      nvcc_options=[f"-D{k}={v}" for k, v in defines.items()] + ["-std=c++17"])


def _capability(t: torch.Tensor) -> str:
    major, minor = torch.cuda.get_device_capability(t.device)
    return f"{major}{minor}"


def _check_contiguous(name: str, tensors) -> None:
    for i, a in enumerate(tensors):
        if not a.is_contiguous():
            raise ValueError(f"{name}: tensor argument {i} {tuple(a.shape)} is not contiguous")


def split_attention(q, k_cache: dict, v_cache: dict, block_tables, seq_lens, part_o, part_ml, *, block_size: int,
                    scale: float, min_chunk: int, doublings: int, splits: int) -> None:
    """Fill part_o float32 [B, Hq, splits, 128] and part_ml float32 [B, Hq, splits, 2] as
    `paged_attention._split_kernel` does: chunk c of sequence b's context (`_seq_chunk`),
    unnormalised output, running max (natural-log units) and sum. q: bf16 [B, Hq, 128]; caches as
    `paged_decode_attention`; block_tables int32 [B, max_blocks], seq_lens int32 [B]. Chunks
    past a sequence's end write nothing."""
    b, hq, _ = q.shape
    hkv = k_cache["codes"].shape[1]
    kernel = _kernel("fp4_decode_attention.cu", "fp4_decode_split", _capability(q), HQ=hq, HKV=hkv, G=hq // hkv,
                     BS=block_size, MIN_CHUNK=min_chunk, DOUBLINGS=doublings, SPLITS=splits,
                     MIN_BLOCKS=LAUNCH["attention_min_blocks"])
    args = [q, k_cache["codes"], k_cache["scales"], k_cache["g"], v_cache["codes"], v_cache["scales"], v_cache["g"],
            block_tables, seq_lens, part_o, part_ml]
    _check_contiguous("split_attention", args)
    kernel(grid=(b, hkv, splits), block=(32, 1, 1), args=args + [block_tables.shape[1], float(scale)])


def grouped_linear(x, codes, scales, g, tiles, num_tiles: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] bf16 with y[rows of e] = x[rows of e] @ dequantize(W_e)^T. x: bf16 [M, K];
    codes uint8 [E, N, K/2]; scales uint8 (E4M3 bits) [E, N, K/16]; g float32 [E]; tiles int32
    [num_tiles, 3]: (expert, first row, end row) of up to GEMM_ROWS rows each, empty ones (no
    rows) allowed, as `linear._tile_list_kernel` lists them. out: where to write y (else new)."""
    m, k = x.shape
    n = codes.shape[1]
    kernel = _kernel("fp4_grouped_gemm.cu", "fp4_grouped_gemm", _capability(x), MIN_BLOCKS=LAUNCH["gemm_min_blocks"])
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device) if out is None else out
    args = [x, codes, scales, g, tiles, y]
    _check_contiguous("grouped_linear", args)
    if m and num_tiles:
        kernel(grid=(num_tiles, (n + 127) // 128, 1), block=(128, 1, 1), args=args + [n, k])
    return y
