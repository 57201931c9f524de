"""RMSNorm and the attention's per-head norm + rotary embedding, as single Triton kernels.

Qwen3's engine forward runs five norms a layer on BF16 activations with FP32 weights. torch has
no fused kernel for that dtype mix, so `F.rms_norm` falls back to its composite (about seven
kernels: upcast, square, mean, add, rsqrt, two products, downcast), and the rotary embedding is
five more per tensor. At decode sizes each of those kernels costs a launch, not bytes.

Both functions compute what the torch code computes, operation for operation:
- `rms_norm`: bf16(fl32(fl32(x * rsqrt(mean(x^2) + eps)) * w)), as torch's composite does in
  FP32; the sum of squares is taken in another order, so r can differ in its last bits and the
  result, rarely, by one BF16 ulp.
- `qk_norm_rope`: that norm per head, then x * cos + rotate_half(x) * sin with every product
  and the sum rounded to BF16 as torch's BF16 ops round them (exact replication).
The torch path (CPU, or backend="torch") is that torch code itself.

Shapes: x bf16 [..., N], weight float32 [N]; qkv bf16 [n, groups, G + 2, d] (per KV group: G
query heads, then K, then V, Megatron's layout), cos / sin bf16 [n, 1, d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp4.api import _use_triton

try:
    import triton
    import triton.language as tl

    from .fp4.triton_fp4 import _bf16, _interpreting, _rms_norm_row
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """F.rms_norm(x, (N,), weight, eps) of bf16 x [..., N] with a float32 weight [N]: bf16, x's shape."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not fit rows of {n}")
    if not _use_triton(x, backend):
        return F.rms_norm(x, (n,), weight, eps)
    rows = x.reshape(-1, n).contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.float().contiguous(), y, eps, N=n,
                                           BLOCK=triton.next_power_of_2(n), INTERPRET=_interpreting(),
                                           enable_fp_fusion=False)  # mean + eps rounds twice, as in torch
    return y.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (x [n, heads, d], cos / sin [n, 1, d]), in x's dtype."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys of qkv [n, groups, G + 2, d] (bf16), each head RMS-normed (q_weight /
    k_weight float32 [d]) then rotated: q bf16 [n, groups * G, d], k bf16 [n, groups, d]."""
    n, groups, width, d = qkv.shape
    g = width - 2
    if d % 2 or q_weight.shape != (d,) or k_weight.shape != (d,) or cos.shape != (n, 1, d) or sin.shape != cos.shape:
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)}, weights {tuple(q_weight.shape)} / "
                         f"{tuple(k_weight.shape)}, cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit")
    if not _use_triton(qkv, backend):
        q = F.rms_norm(qkv[:, :, :g].reshape(n, groups * g, d), (d,), q_weight, eps)
        k = F.rms_norm(qkv[:, :, -2], (d,), k_weight, eps)
        return rope(q, cos, sin), rope(k, cos, sin)
    qkv = qkv.contiguous()
    q = torch.empty((n, groups * g, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((n, groups, d), dtype=qkv.dtype, device=qkv.device)
    if n:
        _qk_norm_rope_kernel[(n * groups * (g + 1),)](
            qkv, q_weight.float().contiguous(), k_weight.float().contiguous(), cos.contiguous(), sin.contiguous(),
            q, k, eps, GROUPS=groups, G=g, D=d, INTERPRET=_interpreting(), enable_fp_fusion=False)
    return q, k


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < N
        x = tl.load(x_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + i, mask=ok, other=0.0)
        tl.store(y_ptr + row * N + i, _rms_norm_row(x, w, tl.sum(x * x, 0), eps, 1.0 / N, INTERPRET), mask=ok)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, eps, GROUPS: tl.constexpr,
                             G: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
        """One head row: query j < G of token-group tg, or its key (j == G)."""
        r = tl.program_id(0).to(tl.int64)
        tg, j = r // (G + 1), r % (G + 1)
        tok = tg // GROUPS
        i = tl.arange(0, D // 2)
        src = qkv_ptr + (tg * (G + 2) + j) * D
        x1 = tl.load(src + i).to(tl.float32)  # the two halves rotate_half swaps
        x2 = tl.load(src + D // 2 + i).to(tl.float32)
        ss = tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)
        is_key = j == G
        w1 = tl.where(is_key, tl.load(wk_ptr + i), tl.load(wq_ptr + i))
        w2 = tl.where(is_key, tl.load(wk_ptr + D // 2 + i), tl.load(wq_ptr + D // 2 + i))
        y1 = _rms_norm_row(x1, w1, ss, eps, 1.0 / D, INTERPRET).to(tl.float32)
        y2 = _rms_norm_row(x2, w2, ss, eps, 1.0 / D, INTERPRET).to(tl.float32)
        c1 = tl.load(cos_ptr + tok * D + i).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * D + D // 2 + i).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * D + i).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * D + D // 2 + i).to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to BF16
        o1 = _bf16(_bf16(y1 * c1, INTERPRET).to(tl.float32) + _bf16(-y2 * s1, INTERPRET).to(tl.float32), INTERPRET)
        o2 = _bf16(_bf16(y2 * c2, INTERPRET).to(tl.float32) + _bf16(y1 * s2, INTERPRET).to(tl.float32), INTERPRET)
        head = (tg % GROUPS) * G + j
        dst = tl.where(is_key, k_ptr + (tok * GROUPS + tg % GROUPS) * D, q_ptr + (tok * GROUPS * G + head) * D)
        tl.store(dst + i, o1)
        tl.store(dst + D // 2 + i, o2)
