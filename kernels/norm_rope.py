"""RMSNorm and the attention's per-head norm + rotary embedding, as single Triton kernels.

Qwen3's engine forward runs five norms a layer on BF16 activations with FP32 weights. torch has
no fused kernel for that dtype mix, so `F.rms_norm` falls back to its composite (about seven
kernels: upcast, square, mean, add, rsqrt, two products, downcast), and the rotary embedding is
five more per tensor. At decode sizes each of those kernels costs a launch, not bytes.

The functions compute what the torch code computes, operation for operation:
- `rms_norm`: bf16(fl32(fl32(x * rsqrt(mean(x^2) + eps)) * w)), as torch's composite does in
  FP32; the sum of squares is taken in another order, so r can differ in its last bits and the
  result, rarely, by one BF16 ulp.
- `rms_norm_backward`: its gradients in one pass over x and the incoming gradient (the trainer's
  norms: in training, torch's composite also runs its backward as about ten elementwise kernels
  over FP32 temporaries, at the QK norms over every head of every token).
- `rope_rows`: the rotary embedding given its BF16 cos / sin rows, and its gradient (the trainer's:
  Megatron's unfused `apply_rotary_pos_emb` makes about five passes each way over q and k).
- `qk_norm_rope`: that norm per head, then x * cos + rotate_half(x) * sin with every product
  and the sum rounded to BF16 as torch's BF16 ops round them (exact replication).
- `qk_norm_rope_into_cache`: the same, with the keys and the values written into the paged KV
  cache by the same kernel (quantized per (token, head) for an FP4 cache): at decode sizes the
  K and V stores were two more launches, and, with qkv's split-K partial products summed in
  the kernel too, the sum one more.
The torch path (CPU, or backend="torch") is that torch code itself.

Shapes: x bf16 [..., N], weight float32 [N]; qkv bf16 [n, groups, G + 2, d] (per KV group: G
query heads, then K, then V, Megatron's layout), cos / sin bf16 [n, 1, d].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .fp4.api import _use_triton, quantize_rows_into
from .fp4.linear import sum_parts

try:
    import triton
    import triton.language as tl

    from .fp4.triton_fp4 import (
        _bf16,
        _e2m1_codes,
        _interpreting,
        _max_propagate_nan,
        _nvfp4_block_scales,
        _pack_pairs,
        _rms_norm_row,
        _row_global_scale,
    )
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None


NORM_GRAD_STEPS = 16  # row tiles one backward program takes: its dweight partial row is 1/16 of theirs


def _norm_tile(n: int) -> tuple[int, int]:
    """(BLOCK, ROWS) of the norm kernels for rows of n: a program takes about 2048 elements (one
    row of a hidden state, 16 of a 128-wide head: QK norms run over ~half a million such rows a
    micro-batch in training, and one row per program left most of each program's lanes idle)."""
    block = triton.next_power_of_2(n)
    return block, max(1, min(64, 2048 // block))


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
        block, per = _norm_tile(n)
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], per),)](
            rows, weight.float().contiguous(), y, eps, rows.shape[0], N=n, BLOCK=block, ROWS=per,
            INTERPRET=_interpreting(), enable_fp_fusion=False)  # mean + eps rounds twice, as in torch
    return y.view(x.shape)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                      backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `rms_norm` at grad (x's shape and dtype): (dx in x's dtype and shape,
    dweight float32 [N]). y = x r w with r = rsqrt(mean(x^2) + eps), so dx = r (g - x r c) with
    g = grad w and c = mean(g x r), and dweight = the sum over rows of grad x r: computed in FP32
    from x (r recomputed), dx rounded once. The torch path is autograd through F.rms_norm."""
    n = x.shape[-1]
    if weight.shape != (n,) or grad.shape != x.shape or grad.dtype != x.dtype:
        raise ValueError(f"rms_norm_backward: grad {grad.dtype} {tuple(grad.shape)} and weight "
                         f"{tuple(weight.shape)} must fit x {x.dtype} {tuple(x.shape)}")
    if not _use_triton(x, backend):
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), weight.detach().float().requires_grad_()
            dx, dw = torch.autograd.grad(F.rms_norm(xr, (n,), wr, eps), (xr, wr), grad)
        return dx, dw
    if x.dtype != torch.bfloat16:  # the kernel rounds dx to BF16
        raise ValueError(f"rms_norm_backward: the Triton path takes bfloat16 x, got {x.dtype}")
    rows = x.reshape(-1, n).contiguous()
    dx = torch.empty_like(rows)
    block, per = _norm_tile(n)
    # each program sums its rows' dweight terms (NORM_GRAD_STEPS tiles), torch then the programs'
    programs = max(1, triton.cdiv(triton.cdiv(rows.shape[0], per), NORM_GRAD_STEPS))
    parts = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _rms_norm_backward_kernel[(programs,)](
            grad.reshape(-1, n).contiguous(), rows, weight.float().contiguous(), dx, parts, eps, rows.shape[0],
            N=n, BLOCK=block, ROWS=per, STEPS=NORM_GRAD_STEPS, INTERPRET=_interpreting(), enable_fp_fusion=False)
    else:
        parts.zero_()
    return dx.view(x.shape), parts.sum(0)


def rope_inv_freq(theta: float, d: int, device=None) -> torch.Tensor:
    """The rotary embedding's inverse frequencies float32 [d/2]: theta^(-2i/d), as Megatron's
    RotaryEmbedding computes them (non-interleaved halves, no scaling)."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context extended `factor` times: 0.1 * mscale * ln(factor) + 1
    (1 for factor <= 1), as DeepSeek's reference, transformers and Megatron define it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(theta: float, d: int, factor: float, original_max_position: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, device=None) -> torch.Tensor:
    """YaRN's inverse frequencies float32 [d/2]: theta^(-2i/d) kept where a channel turns more
    than beta_fast times over the pre-training context `original_max_position`, divided by
    `factor` where it turns fewer than beta_slow times, a linear ramp between (the bounds
    floored / ceiled), as transformers' and Megatron's YaRN compute them."""
    def bound(rotations):
        return d * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(bound(beta_fast)), 0), min(math.ceil(bound(beta_slow)), d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    keep = 1 - ramp  # where the pre-training frequency stays (extrapolation)
    # (1 - keep), not ramp: transformers' float32 arithmetic, so the tables agree bit for bit
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, 1, d] in `dtype` (the activations', as Megatron's bshd path casts them) at
    positions pos (int [n]): the same for q and k and every layer; times `scale` in FP32 first
    (YaRN's attention factor, as Megatron applies its mscale)."""
    freqs = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)[:, None]
    if scale == 1.0:  # plain RoPE: no extra pass over the tables
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (x [n, heads, d], cos / sin [n, 1, d]), in x's dtype."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool = False,
              backend: str = "auto") -> torch.Tensor:
    """The rotary embedding of x bf16 [S, ..., d], row s of its leading dim turned by cos / sin
    bf16 [S, d]: x * cos + rotate_half(x) * sin, each product and the sum rounded to BF16 as
    torch's BF16 operations round them (Megatron's `apply_rotary_pos_emb` bit for bit, given its
    cos and sin). transpose=True: its gradient at an incoming gradient x, x * cos +
    rotate_half^T(x * sin) with rotate_half^T(u) = (u2, -u1), rounded as autograd rounds it.
    A new tensor of x's shape."""
    n, d = x.shape[0], x.shape[-1]
    if cos.shape != (n, d) or sin.shape != (n, d) or d % 2:
        raise ValueError(f"rope_rows: cos and sin must be [{n}, {d}] for x {tuple(x.shape)} (d even), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if not _use_triton(x, backend):
        c, s = (t.view(n, *([1] * (x.dim() - 2)), d) for t in (cos, sin))
        if transpose:
            u1, u2 = (x * s).chunk(2, -1)
            return x * c + torch.cat([u2, -u1], -1)
        return rope(x, c, s)
    if x.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16:
        raise ValueError(f"rope_rows: the Triton path takes bfloat16 x, cos and sin, got {x.dtype}, {cos.dtype}, "
                         f"{sin.dtype}")  # it rounds every operation to BF16
    rows = x.reshape(-1, d).contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0]:
        half = triton.next_power_of_2(d // 2)
        per = max(1, min(64, 1024 // half))
        _rope_rows_kernel[(triton.cdiv(rows.shape[0], per),)](
            rows, cos.contiguous(), sin.contiguous(), y, rows.shape[0], rows.shape[0] // n, D=d, HALF=half, ROWS=per,
            TRANSPOSE=transpose, INTERPRET=_interpreting(), enable_fp_fusion=False)
    return y.view(x.shape)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """MLA's rope part [..., r] with its pairs (2i, 2i+1) regrouped as halves (even channels,
    then odd), where the non-interleaved `rope` turns them: DeepSeek's interleaved RoPE, as
    Megatron's MLA (and transformers' rope_interleave) apply it."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)

def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys of qkv [n, groups, G + 2, d] (bf16), each head RMS-normed (q_weight /
    k_weight float32 [d]) then rotated: q bf16 [n, groups * G, d], k bf16 [n, groups, d]. qkv
    may also be a split-K GEMM's FP32 partial products of it, [S, n, groups, G + 2, d]
    (`fp4_linear_parts`): the kernel adds them first as `sum_parts` does."""
    n, groups, g, d = _check_qkv(qkv, q_weight, k_weight, cos, sin)
    if not _use_triton(qkv, backend):
        qkv = sum_parts(qkv)
        q = F.rms_norm(qkv[:, :, :g].reshape(n, groups * g, d), (d,), q_weight, eps)
        k = F.rms_norm(qkv[:, :, -2], (d,), k_weight, eps)
        return rope(q, cos, sin), rope(k, cos, sin)
    q = torch.empty((n, groups * g, d), dtype=torch.bfloat16, device=qkv.device)
    k = torch.empty((n, groups, d), dtype=torch.bfloat16, device=qkv.device)
    _launch_qk_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, q, STORE_K, k=k)
    return q, k


def qk_norm_rope_into_cache(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: dict, v_cache: dict, slots: torch.Tensor,
                            *, backend: str = "auto") -> torch.Tensor:
    """`qk_norm_rope`'s queries, with its keys and qkv's values (qkv[:, :, -1]) written into one
    layer of a paged KV cache at `slots` (int64 [n]) instead of returned, in the same kernel. A
    cache is {"codes", "scales", "g"} (FP4: each (token, KV head) row quantized as
    `quantize_rows_into` quantizes it) or {"rows"} (BF16 [slots, groups, d]).

    Returns: q bf16 [n, groups * G, d]."""
    n, groups, g, d = _check_qkv(qkv, q_weight, k_weight, cos, sin)
    fp4 = "codes" in k_cache
    want = {"codes": d // 2, "scales": d // 16, "g": 1} if fp4 else {"rows": d}
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if set(cache) != set(want) or any(cache[t].dim() != 3 or cache[t].shape[1:] != (groups, width)
                                          or not cache[t].is_contiguous() for t, width in want.items()):
            raise ValueError(f"qk_norm_rope_into_cache: {name} must hold contiguous "
                             f"{ {t: [None, groups, w] for t, w in want.items()} }, got "
                             f"{ {t: tuple(v.shape) for t, v in cache.items()} }")
    if slots.shape != (n,) or slots.dtype != torch.int64:
        raise ValueError(f"qk_norm_rope_into_cache: slots must be int64 [{n}], got {slots.dtype} {tuple(slots.shape)}")
    if not _use_triton(qkv, backend) or (fp4 and d % 32):  # the kernel quantizes a row's halves block by block
        q, k = qk_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, backend=backend)
        v = sum_parts(qkv)[:, :, -1]
        for cache, t in ((k_cache, k), (v_cache, v)):
            if fp4:
                quantize_rows_into(t, slots, cache["codes"], cache["scales"], cache["g"], backend=backend)
            else:
                cache["rows"][slots.to(t.device)] = t
        return q
    q = torch.empty((n, groups * g, d), dtype=torch.bfloat16, device=qkv.device)
    caches = [k_cache[t] for t in want] + [v_cache[t] for t in want]
    if not fp4:  # one tensor each: the kernel's unused FP4 pointers
        caches = [caches[0], caches[0], caches[0], caches[1], caches[1], caches[1]]
    _launch_qk_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, q, STORE_FP4 if fp4 else STORE_BF16,
                         slots=slots.to(qkv.device), caches=caches)
    return q


# What the norm + RoPE kernel does with the keys (and values); its warps per head row.
STORE_K, STORE_BF16, STORE_FP4 = 0, 1, 2
QK_WARPS = 1


def _check_qkv(qkv, q_weight, k_weight, cos, sin) -> tuple[int, int, int, int]:
    """(n, groups, G, d) of qkv [n, groups, G + 2, d] (bf16) or its partial products [S, ...] (float32)."""
    parts = qkv.dim() == 5 and qkv.dtype == torch.float32
    if not (parts or (qkv.dim() == 4 and qkv.dtype == torch.bfloat16)):
        raise ValueError(f"qk_norm_rope: qkv must be bfloat16 [n, groups, G + 2, d] or float32 partial products "
                         f"[S, n, groups, G + 2, d], got {qkv.dtype} {tuple(qkv.shape)}")
    n, groups, width, d = qkv.shape[-4:]
    if d % 2 or width < 3 or q_weight.shape != (d,) or k_weight.shape != (d,) or cos.shape != (n, 1, d) \
            or sin.shape != cos.shape:
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)}, weights {tuple(q_weight.shape)} / "
                         f"{tuple(k_weight.shape)}, cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit")
    return n, groups, width - 2, d


def _launch_qk_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, q, store, *, k=None, slots=None, caches=None):
    """One program per head row of each (token, KV group): its G queries, its key, and (storing
    into a cache) its value."""
    n, groups, width, d = qkv.shape[-4:]
    splits = qkv.shape[0] if qkv.dim() == 5 else 0
    if not n:
        return
    qkv = qkv.contiguous()
    rows = width - 1 if store == STORE_K else width
    w = min(16, d // 2)
    caches = caches or [q] * 6
    _qk_norm_rope_kernel[(n * groups * rows,)](
        qkv, q_weight.float().contiguous(), k_weight.float().contiguous(), cos.contiguous(), sin.contiguous(), q,
        q if k is None else k, q if slots is None else slots, *caches, eps, n * groups * width * d,
        GROUPS=groups, G=width - 2, D=d, W=w, SPLITS=splits, STORE=store, INTERPRET=_interpreting(),
        num_warps=QK_WARPS, enable_fp_fusion=False)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, eps, R, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         INTERPRET: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        ok = (row < R) & (i < N)
        x = tl.load(x_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + i, mask=i < N, other=0.0)
        tl.store(y_ptr + row * N + i, _rms_norm_row(x, w, tl.sum(x * x, 1)[:, None], eps, 1.0 / N, INTERPRET),
                 mask=ok)

    @triton.jit
    def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, parts_ptr, eps, R, N: tl.constexpr,
                                  BLOCK: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr,
                                  INTERPRET: tl.constexpr):
        """Program p takes STEPS tiles of ROWS rows from row p * STEPS * ROWS (rows past R
        masked); its dweight terms summed in FP32 into row p of parts."""
        p = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)[None, :]
        w = tl.load(w_ptr + i, mask=i < N, other=0.0)
        dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for k in range(0, STEPS):
            row = (p * STEPS + k) * ROWS + tl.arange(0, ROWS)[:, None]
            ok = (row < R) & (i < N)
            x = tl.load(x_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)
            r = tl.math.rsqrt(tl.sum(x * x, 1)[:, None] * (1.0 / N) + eps)
            xr = x * r
            g = dy * w
            c = tl.sum(g * xr, 1)[:, None] * (1.0 / N)
            tl.store(dx_ptr + row * N + i, _bf16(r * (g - xr * c), INTERPRET), mask=ok)
            dw += dy * xr
        tl.store(parts_ptr + p * N + i, tl.sum(dw, 0)[None, :], mask=i < N)

    @triton.jit
    def _rope_rows_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, R, per_token, D: tl.constexpr, HALF: tl.constexpr,
                          ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, INTERPRET: tl.constexpr):
        """ROWS rows of D a program; row r turned by cos / sin row r // per_token."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        i = tl.arange(0, HALF)[None, :]
        ok = (row < R) & (i < D // 2)
        at, tab = row * D + i, row // per_token * D + i
        x1 = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + at + D // 2, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + tab, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tab + D // 2, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tab, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tab + D // 2, mask=ok, other=0.0).to(tl.float32)
        # products of two BF16 values are exact in FP32: each rounding below is the BF16 op's
        a1 = _bf16(x1 * c1, INTERPRET).to(tl.float32)
        a2 = _bf16(x2 * c2, INTERPRET).to(tl.float32)
        if TRANSPOSE:  # (u2, -u1) of u = bf16(x * sin)
            b1 = _bf16(x2 * s2, INTERPRET).to(tl.float32)
            b2 = -_bf16(x1 * s1, INTERPRET).to(tl.float32)
        else:  # (-x2, x1) * sin
            b1 = -_bf16(x2 * s1, INTERPRET).to(tl.float32)
            b2 = _bf16(x1 * s2, INTERPRET).to(tl.float32)
        tl.store(y_ptr + at, _bf16(a1 + b1, INTERPRET), mask=ok)
        tl.store(y_ptr + at + D // 2, _bf16(a2 + b2, INTERPRET), mask=ok)

    @triton.jit
    def _row_halves(ptr, idx, D: tl.constexpr, PART_STRIDE, SPLITS: tl.constexpr, INTERPRET: tl.constexpr):
        """The two halves of a bf16 row at ptr (idx: [D/2/W, W] offsets in a half) as float32; of
        SPLITS float32 partial rows PART_STRIDE apart, their sum in split order rounded to BF16."""
        if SPLITS == 0:
            return tl.load(ptr + idx).to(tl.float32), tl.load(ptr + D // 2 + idx).to(tl.float32)
        else:
            x1 = tl.load(ptr + idx)
            x2 = tl.load(ptr + D // 2 + idx)
            for z in tl.static_range(1, SPLITS):
                x1 += tl.load(ptr + z * PART_STRIDE + idx)
                x2 += tl.load(ptr + z * PART_STRIDE + D // 2 + idx)
            return _bf16(x1, INTERPRET).to(tl.float32), _bf16(x2, INTERPRET).to(tl.float32)

    @triton.jit
    def _store_fp4_row(codes_ptr, scales_ptr, g_ptr, row, x1, x2, D: tl.constexpr):
        """Row-scaled NVFP4 of one row given as halves x1, x2 [D/32, 16] (float32 of BF16 values)
        at cache row `row`, as `_quantize_kernel` computes it (G_ROW_AMAX)."""
        a1 = tl.reduce(tl.abs(x1), 1, _max_propagate_nan)  # block amaxes [D/32]
        a2 = tl.reduce(tl.abs(x2), 1, _max_propagate_nan)
        g = _row_global_scale(_max_propagate_nan(tl.reduce(a1, 0, _max_propagate_nan),
                                                 tl.reduce(a2, 0, _max_propagate_nan)))
        s1, b1 = _nvfp4_block_scales(a1, g)
        s2, b2 = _nvfp4_block_scales(a2, g)
        c1 = _e2m1_codes(tl.div_rn(x1, (s1 * g)[:, None]), 0, 0, False)
        c2 = _e2m1_codes(tl.div_rn(x2, (s2 * g)[:, None]), 0, 0, False)
        hb = tl.arange(0, D // 32)
        packed = row * (D // 2) + hb[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(codes_ptr + packed, _pack_pairs(c1))
        tl.store(codes_ptr + D // 4 + packed, _pack_pairs(c2))
        tl.store(scales_ptr + row * (D // 16) + hb, b1.to(tl.uint8))
        tl.store(scales_ptr + row * (D // 16) + D // 32 + hb, b2.to(tl.uint8))
        tl.store(g_ptr + row, g)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, slots_ptr, kc_ptr, ks_ptr,
                             kg_ptr, vc_ptr, vs_ptr, vg_ptr, eps, PART_STRIDE, GROUPS: tl.constexpr,
                             G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, SPLITS: tl.constexpr,
                             STORE: tl.constexpr, INTERPRET: tl.constexpr):
        """One head row of token-group tg: query j < G, its key (j == G) or, storing into a
        cache, its value (j == G + 1). Queries and keys are normed and rotated; STORE_K writes
        keys to k_ptr, STORE_BF16 / STORE_FP4 keys and values into the cache (kc/ks/kg,
        vc/vs/vg: codes, scales, g; BF16 rows in kc / vc) at row slots[token] * GROUPS + group."""
        ROWS: tl.constexpr = G + 1 if STORE == 0 else G + 2
        r = tl.program_id(0).to(tl.int64)
        tg, j = r // ROWS, r % ROWS
        tok = tg // GROUPS
        idx = tl.arange(0, D // 2 // W)[:, None] * W + tl.arange(0, W)[None, :]  # a half as [D/2/W, W]
        x1, x2 = _row_halves(qkv_ptr + (tg * (G + 2) + j) * D, idx, D, PART_STRIDE, SPLITS, INTERPRET)
        ss = tl.sum(tl.sum(x1 * x1, 1), 0) + tl.sum(tl.sum(x2 * x2, 1), 0)
        is_key = j == G
        w1 = tl.where(is_key, tl.load(wk_ptr + idx), tl.load(wq_ptr + idx))
        w2 = tl.where(is_key, tl.load(wk_ptr + D // 2 + idx), tl.load(wq_ptr + D // 2 + idx))
        y1 = _rms_norm_row(x1, w1, ss, eps, 1.0 / D, INTERPRET).to(tl.float32)
        y2 = _rms_norm_row(x2, w2, ss, eps, 1.0 / D, INTERPRET).to(tl.float32)
        c1 = tl.load(cos_ptr + tok * D + idx).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * D + D // 2 + idx).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * D + idx).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * D + D // 2 + idx).to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to BF16
        o1 = _bf16(_bf16(y1 * c1, INTERPRET).to(tl.float32) + _bf16(-y2 * s1, INTERPRET).to(tl.float32), INTERPRET)
        o2 = _bf16(_bf16(y2 * c2, INTERPRET).to(tl.float32) + _bf16(y1 * s2, INTERPRET).to(tl.float32), INTERPRET)
        group = tg % GROUPS
        if j < G:
            dst = q_ptr + (tok * GROUPS * G + group * G + j) * D
            tl.store(dst + idx, o1)
            tl.store(dst + D // 2 + idx, o2)
        elif STORE == 0:
            dst = k_ptr + (tok * GROUPS + group) * D
            tl.store(dst + idx, o1)
            tl.store(dst + D // 2 + idx, o2)
        else:
            row = tl.load(slots_ptr + tok) * GROUPS + group
            if is_key:  # the normed, rotated key
                h1, h2 = o1.to(tl.float32), o2.to(tl.float32)
            else:  # the value as it is
                h1, h2 = x1, x2
            if STORE == 1:
                dst = tl.where(is_key, kc_ptr, vc_ptr) + row * D
                tl.store(dst + idx, h1.to(tl.bfloat16))
                tl.store(dst + D // 2 + idx, h2.to(tl.bfloat16))
            elif is_key:
                _store_fp4_row(kc_ptr, ks_ptr, kg_ptr, row, h1, h2, D)
            else:
                _store_fp4_row(vc_ptr, vs_ptr, vg_ptr, row, h1, h2, D)
