"""The MoE layer's bookkeeping around its grouped GEMMs, as one Triton kernel each.

- `expert_order`: the stable order of the (token, slot) rows by expert (rows of one expert keep
  their token order), with the per-expert row counts and each row's position. torch needs a
  radix sort, two integer divisions and a scatter-add for it: at decode sizes, five launches.
- `combine_experts`: out[t] = the sum over t's experts of bf16(y * gate), added in FP32 in the
  rows' (expert-sorted) order and rounded to BF16 once: what `index_add_` computes on the CPU
  (its BF16 rows accumulate in FP32). On a GPU `index_add_` adds BF16 rows with atomics, each
  addition rounded, in whatever order they land; the kernel's order and rounding are fixed.

The torch path (CPU, or backend="torch") is the torch code itself; the Triton kernels give the
same results bit for bit.

Shapes: top int64 [n, k] (expert ids, distinct per row); tok, slot int64 [n * k], pos int64
[n * k] (row (t, j) sits at pos[t * k + j]), counts int64 [E]; y bf16 [n * k, H] in the sorted
order, gate float32 [n, k]; out bf16 [n, H].
"""

from __future__ import annotations

import torch

from .fp4.api import _use_triton

try:
    import triton
    import triton.language as tl

    from .fp4.triton_fp4 import _bf16_rne, _interpreting
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None

BLOCK = 1024  # rows per loop step of the order kernel


def expert_order(top: torch.Tensor, num_experts: int, *, backend: str = "auto"):
    """(tok, slot, pos, counts) of the routing top [n, k]: row i of the expert-sorted order is
    token tok[i]'s slot slot[i]; pos inverts it; counts[e] rows go to expert e."""
    n, k = top.shape
    flat = top.reshape(-1)
    if not _use_triton(top, backend):
        # stable sort by expert id; 16-bit keys take 2 radix passes where int64 ids took 8
        order = torch.sort(flat.to(torch.int16 if num_experts <= 32767 else torch.int32), stable=True).indices
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel(), device=top.device)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=top.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # on the device: bincount would synchronise to size its output
        return order // k, order % k, pos, counts
    tok, slot, pos = (torch.empty(n * k, dtype=torch.int64, device=top.device) for _ in range(3))
    counts = torch.empty(num_experts, dtype=torch.int64, device=top.device)
    _expert_order_kernel[(num_experts,)](flat.contiguous(), tok, slot, pos, counts, n * k, K=k,
                                         N_PAD=max(BLOCK, triton.next_power_of_2(max(n * k, 1))), BLOCK=BLOCK)
    return tok, slot, pos, counts


def combine_experts(y: torch.Tensor, gate: torch.Tensor, tok: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
                    *, residual: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """out [n, H] bf16: each token's expert outputs y (bf16, sorted rows) weighted by its gates
    (float32 [n, k]), summed as index_add_ sums them on the CPU (see the module docstring); with
    `residual` (bf16 [n, H]), residual + out as torch adds two BF16 tensors (in the same kernel)."""
    n, k = gate.shape
    if y.shape[0] != n * k or y.dtype != torch.bfloat16:
        raise ValueError(f"combine_experts: y must be bfloat16 [{n * k}, H], got {y.dtype} {tuple(y.shape)}")
    h = y.shape[1]
    if residual is not None and (residual.shape != (n, h) or residual.dtype != torch.bfloat16):
        raise ValueError(f"combine_experts: residual must be bfloat16 [{n}, {h}], got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    if not _use_triton(y, backend):
        out = torch.zeros((n, h), dtype=y.dtype, device=y.device)
        out = out.index_add_(0, tok, (y * gate[tok, slot, None]).to(y.dtype))
        return out if residual is None else residual + out
    out = torch.empty((n, h), dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(h))
    if n:
        res = out if residual is None else residual.contiguous()
        _combine_kernel[(n, triton.cdiv(h, block_h))](y.contiguous(), gate.float().contiguous(), pos, res, out, h, K=k,
                                                      K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h,
                                                      RESIDUAL=residual is not None, INTERPRET=_interpreting(),
                                                      enable_fp_fusion=False)
    return out


if triton is not None:

    @triton.jit
    def _expert_order_kernel(ids_ptr, tok_ptr, slot_ptr, pos_ptr, counts_ptr, N, K: tl.constexpr,
                             N_PAD: tl.constexpr, BLOCK: tl.constexpr):
        """Expert e's rows: its first position is the number of rows of lower experts, then its
        rows in index order (a counting sort, stable)."""
        e = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        before = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
        for start in range(0, N_PAD, BLOCK):
            ids = tl.load(ids_ptr + start + i, mask=start + i < N, other=2**31 - 1)
            before += tl.sum((ids < e).to(tl.int32), 0)
        at = before
        for start in range(0, N_PAD, BLOCK):
            f = start + i
            hit = (tl.load(ids_ptr + f, mask=f < N, other=-1) == e).to(tl.int32)
            p = at + tl.cumsum(hit, 0) - 1
            ok = hit > 0
            tl.store(tok_ptr + p, f // K, mask=ok)
            tl.store(slot_ptr + p, f % K, mask=ok)
            tl.store(pos_ptr + f, p.to(tl.int64), mask=ok)
            at += tl.sum(hit, 0)
        tl.store(counts_ptr + e, (at - before).to(tl.int64))

    @triton.jit
    def _combine_kernel(y_ptr, gate_ptr, pos_ptr, res_ptr, out_ptr, H, K: tl.constexpr, K_PAD: tl.constexpr,
                        BLOCK_H: tl.constexpr, RESIDUAL: tl.constexpr, INTERPRET: tl.constexpr):
        """Token t, columns [BLOCK_H * c, ...): its k rows added in position order (then, with
        RESIDUAL, the BF16 sum added to the residual row in FP32 and rounded again)."""
        t, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        j = tl.arange(0, K_PAD)
        ok_j = j < K
        p = tl.load(pos_ptr + t * K + j, mask=ok_j, other=2**62)
        g = tl.load(gate_ptr + t * K + j, mask=ok_j, other=0.0)
        rank = tl.sum(((p[None, :] < p[:, None]) & ok_j[None, :]).to(tl.int32), 1)  # rows of t before each
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(K):
            here = rank == r
            row = tl.sum(tl.where(here, p, 0), 0)
            v = tl.load(y_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32) * tl.sum(tl.where(here, g, 0.0), 0)
            if INTERPRET:  # bf16(y * gate) (the interpreter's cast truncates), summed in FP32
                acc += _bf16_rne(v).to(tl.float32)
            else:
                acc += v.to(tl.bfloat16).to(tl.float32)
        out = _bf16_rne(acc) if INTERPRET else acc.to(tl.bfloat16)
        if RESIDUAL:
            out = out.to(tl.float32) + tl.load(res_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
            out = _bf16_rne(out) if INTERPRET else out.to(tl.bfloat16)
        tl.store(out_ptr + t * H + cols, out, mask=ok)
