"""The MoE layer's routing and bookkeeping around its grouped GEMMs, as Triton kernels.

- `route`: the router's FP32 logits, their top k and the softmax over those k. torch needs a
  cast, an FP32 GEMM and its split-K reduction, a two-kernel top-k and a softmax: six launches
  at decode sizes, against two here (logits in split-H partial sums; then their sum in a fixed
  order, top k and softmax per token).
- `top_k_sigmoid_grouped`: the DeepSeek-V3 family's selection (sigmoid scores, an expert bias
  that only picks, group-limited top-k, scaled gates), on FP32 logits (torch).
- `expert_order`: the stable order of the (token, slot) rows by expert (rows of one expert keep
  their token order), with the per-expert row counts and each row's position. torch needs a
  radix sort, two integer divisions and a scatter-add for it: at decode sizes, five launches.
- `scale_rows` / `scale_rows_backward`: the trainer's gate scaling of expert outputs,
  bf16(y * gate) one row per gate, and its gradients (dy = bf16(grad * gate), dgate = the row's
  FP32 sum of grad * y), one pass each way. torch's mixed-dtype product runs its generic
  dynamic-cast kernel (1.1 ms for 131072 x 2048 on an H200, 2026-12-05 profile), and its dgate
  writes, then reads, an FP32 temporary of the rows' size.
- `combine_experts`: out[t] = the sum over t's experts of bf16(y * gate), added in FP32 in the
  rows' (expert-sorted) order and rounded to BF16 once: what `index_add_` computes on the CPU
  (its BF16 rows accumulate in FP32). On a GPU `index_add_` adds BF16 rows with atomics, each
  addition rounded, in whatever order they land; the kernel's order and rounding are fixed.

The torch path (CPU, or backend="torch") is the torch code itself. The Triton kernels give the
same results bit for bit, except `route`'s logits: they are FP32 sums of the same exact
products (BF16 h times BF16-valued weights) taken in another order, so they can differ in their
last bits, and a top k whose k-th and (k+1)-th logits are that close can differ.

Shapes: h bf16 [n, H], router weight [E, H]; top int64 [n, k] (expert ids, distinct per row);
tok, slot int64 [n * k], pos int64 [n * k] (row (t, j) sits at pos[t * k + j]), counts int64
[E]; y bf16 [n * k, H] in the sorted order, gate float32 [n, k]; out bf16 [n, H].
"""

from __future__ import annotations

import torch

from .fp4.api import _use_triton

try:
    import triton
    import triton.language as tl

    from .fp4.triton_fp4 import _bf16_rne, _exp, _interpreting
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None

BLOCK = 1024  # rows per loop step of the order kernel
# Router logits: tiles of ROUTE_BT tokens x ROUTE_BE experts, H in steps of ROUTE_BH, split over
# H until about ROUTE_PROGRAMS programs run (a decode batch has few token tiles).
ROUTE_BT, ROUTE_BE, ROUTE_BH, ROUTE_PROGRAMS = 16, 32, 128, 128
TOPK_BT = 2  # tokens per top-k program: k rounds of reductions are a serial chain, so many small programs
# Columns and warps of a combine program (one token's): batch 64, H 2048: 2.59 us, 1024 columns 2.71
COMBINE = {"block_h": 512, "num_warps": 4}
SCALE_BLOCK = 2048  # columns of a scale_rows program (a whole row at Qwen3-30B-A3B's hidden 2048)


def route(h: torch.Tensor, weight: torch.Tensor, k: int, *, backend: str = "auto"):
    """(top int64 [n, k], gate float32 [n, k]): each token's k experts by descending router logit
    (logits = h.float() @ weight.T in FP32; h bf16 [n, H], weight float32 or bf16 [E, H] holding
    BF16 values) and the softmax of their k logits."""
    n, hidden = h.shape
    e = weight.shape[0]
    if weight.shape != (e, hidden) or not 1 <= k <= e:
        raise ValueError(f"route: weight {tuple(weight.shape)} and top-{k} do not fit h {tuple(h.shape)}")
    if not _use_triton(h, backend):
        return top_k_softmax(router_logits(h, weight), k)
    if h.dtype != torch.bfloat16:
        raise ValueError(f"route: the kernel takes bfloat16 h, got {h.dtype}")
    top = torch.empty((n, k), dtype=torch.int64, device=h.device)
    gate = torch.empty((n, k), dtype=torch.float32, device=h.device)
    if n == 0:
        return top, gate
    blocks = (triton.cdiv(n, ROUTE_BT), triton.cdiv(e, ROUTE_BE))
    steps = triton.cdiv(hidden, ROUTE_BH)
    want = max(1, ROUTE_PROGRAMS // (blocks[0] * blocks[1]))
    splits = max(z for z in range(1, min(steps, want) + 1) if steps % z == 0)  # equal shares of H
    part = torch.empty((splits, n, e), dtype=torch.float32, device=h.device)
    _router_logits_kernel[blocks + (splits,)](h.contiguous(), weight.contiguous(), part, n, e, hidden,
                                              STEPS=steps // splits, BT=ROUTE_BT, BE=ROUTE_BE, BH=ROUTE_BH,
                                              INTERPRET=_interpreting())
    _topk_softmax_kernel[(triton.cdiv(n, TOPK_BT),)](part, top, gate, n, e, SPLITS=splits, K=k,
                                                     K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(e),
                                                     BT=TOPK_BT, INTERPRET=_interpreting(), num_warps=1)
    return top, gate


def router_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's FP32 logits [n, E] of h [n, H] (bf16) and weight [E, H] (BF16 values), as the
    trainer's router computes them (Megatron's moe_router_dtype fp32)."""
    return h.float() @ weight.float().T


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top int64 [n, k], gate float32 [n, k]): each row's k largest logits (float32 [n, E]) by
    descending value and the softmax over those k."""
    top_logits, top = torch.topk(logits, k, dim=-1)
    return top, torch.softmax(top_logits, -1)


def top_k_sigmoid_grouped(logits: torch.Tensor, k: int, bias: torch.Tensor, *, n_group: int = 1, topk_group: int = 1,
                          scaling: float = 1.0, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (also GLM-4.5's): (top int64 [n, k], gate float32 [n, k]).

    Scores are sigmoid(logits) (float32 [n, E]). The expert bias (float32 [E], the aux-loss-free
    balancing correction) only picks: experts are chosen by score + bias, first the topk_group of
    n_group equal groups with the largest sum of their two best biased scores, then the top k of
    those groups' experts, by descending biased score. Gates are the chosen experts' unbiased
    scores, divided by their sum (+1e-20) when `normalize`, times `scaling`. The reference is
    DeepSeek-V3's inference code (and transformers' DeepseekV3TopkRouter, which the tests use).
    """
    n, e = logits.shape
    if bias.shape != (e,) or e % n_group or not 1 <= topk_group <= n_group or not 1 <= k <= e * topk_group // n_group:
        raise ValueError(f"top_k_sigmoid_grouped: {e} experts, bias {tuple(bias.shape)}, {n_group} groups keeping "
                         f"{topk_group} and top-{k} do not fit")
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if n_group > 1:
        grouped = choice.view(n, n_group, e // n_group)
        group_score = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(topk_group, -1).indices,
                                                                        True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
    top = choice.topk(k, dim=-1).indices
    gate = scores.gather(1, top)
    if normalize:
        gate = gate / (gate.sum(-1, keepdim=True) + 1e-20)
    return top, gate * scaling


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
    block_h = min(COMBINE["block_h"], triton.next_power_of_2(h))
    if n:
        res = out if residual is None else residual.contiguous()
        _combine_kernel[(n, triton.cdiv(h, block_h))](y.contiguous(), gate.float().contiguous(), pos, res, out, h, K=k,
                                                      K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h,
                                                      RESIDUAL=residual is not None, INTERPRET=_interpreting(),
                                                      num_warps=COMBINE["num_warps"], enable_fp_fusion=False)
    return out


def scale_rows(y: torch.Tensor, gate: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """bf16(y * gate[:, None]) for y bf16 [R, H] and gate float32 [R]: the product in FP32, rounded
    once (torch's mixed-dtype product into a BF16 `out=`, bit for bit). bf16 [R, H]."""
    rows, h = _check_scaled(y, gate, "scale_rows")
    if not _use_triton(y, backend):
        return torch.mul(y, gate.unsqueeze(-1), out=torch.empty_like(y))
    out = torch.empty_like(y)
    block = min(SCALE_BLOCK, triton.next_power_of_2(h))
    if rows:
        _scale_rows_kernel[(rows, triton.cdiv(h, block))](y.contiguous(), gate.contiguous(), out, h, BLOCK=block,
                                                          INTERPRET=_interpreting(), enable_fp_fusion=False)
    return out


def scale_rows_backward(grad: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, *, backend: str = "auto"):
    """The gradients of `scale_rows` at grad bf16 [R, H]: (dy bf16 [R, H] = bf16(grad * gate), bit
    for bit as torch; dgate float32 [R] = sum over H of grad * y in FP32, autograd's formula, summed
    in the kernel's order: within FP32 rounding of torch's)."""
    rows, h = _check_scaled(y, gate, "scale_rows_backward")
    if grad.shape != y.shape or grad.dtype != y.dtype:
        raise ValueError(f"scale_rows_backward: grad must be {y.dtype} {tuple(y.shape)}, got {grad.dtype} "
                         f"{tuple(grad.shape)}")
    if not _use_triton(y, backend):
        return (torch.mul(grad, gate.unsqueeze(-1), out=torch.empty_like(grad)), (grad.float() * y).sum(-1))
    dy, dgate = torch.empty_like(y), torch.empty(rows, dtype=torch.float32, device=y.device)
    if rows:
        block = min(SCALE_BLOCK, triton.next_power_of_2(h))
        _scale_rows_backward_kernel[(rows,)](grad.contiguous(), y.contiguous(), gate.contiguous(), dy, dgate, h,
                                             BLOCK=block, STEPS=triton.cdiv(h, block), INTERPRET=_interpreting(),
                                             enable_fp_fusion=False)
    return dy, dgate


def _check_scaled(y: torch.Tensor, gate: torch.Tensor, what: str) -> tuple[int, int]:
    if y.dim() != 2 or y.dtype != torch.bfloat16 or gate.shape != y.shape[:1] or gate.dtype != torch.float32:
        raise ValueError(f"{what}: y must be bfloat16 [R, H] and gate float32 [R], got {y.dtype} "
                         f"{tuple(y.shape)} and {gate.dtype} {tuple(gate.shape)}")
    return y.shape


if triton is not None:

    @triton.jit
    def _scale_rows_kernel(y_ptr, gate_ptr, out_ptr, H, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        v = tl.load(y_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32) * tl.load(gate_ptr + row)
        tl.store(out_ptr + row * H + cols, _bf16_rne(v) if INTERPRET else v.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _scale_rows_backward_kernel(grad_ptr, y_ptr, gate_ptr, dy_ptr, dgate_ptr, H, BLOCK: tl.constexpr,
                                    STEPS: tl.constexpr, INTERPRET: tl.constexpr):
        """One row: dy in STEPS steps of BLOCK columns, and the FP32 sum of grad * y over them."""
        row = tl.program_id(0).to(tl.int64)
        gate = tl.load(gate_ptr + row)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for step in tl.static_range(STEPS):
            cols = step * BLOCK + tl.arange(0, BLOCK)
            ok = cols < H
            g = tl.load(grad_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
            acc += g * tl.load(y_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
            v = g * gate
            tl.store(dy_ptr + row * H + cols, _bf16_rne(v) if INTERPRET else v.to(tl.bfloat16), mask=ok)
        tl.store(dgate_ptr + row, tl.sum(acc, 0))

    @triton.jit
    def _router_logits_kernel(h_ptr, w_ptr, part_ptr, n, E, H, STEPS: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                              BH: tl.constexpr, INTERPRET: tl.constexpr):
        """Split z's partial logits [BT tokens, BE experts] over its STEPS steps of H: BF16
        products, exact, summed in FP32."""
        t0, e0, z = tl.program_id(0) * BT, tl.program_id(1) * BE, tl.program_id(2)
        rows, experts = t0 + tl.arange(0, BT), e0 + tl.arange(0, BE)
        ok_t, ok_e = rows < n, experts < E
        acc = tl.zeros([BT, BE], dtype=tl.float32)
        for i in range(0, STEPS):
            cols = (z * STEPS + i) * BH + tl.arange(0, BH)
            ok_h = cols < H
            x = tl.load(h_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], mask=ok_t[:, None] & ok_h[None, :],
                        other=0.0)
            w = tl.load(w_ptr + experts[:, None] * H + cols[None, :], mask=ok_e[:, None] & ok_h[None, :], other=0.0)
            if INTERPRET:  # the interpreter's dot would multiply BF16 bit patterns
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:  # the weight holds BF16 values: exact products
                acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
        dst = part_ptr + (z * n + rows[:, None].to(tl.int64)) * E + experts[None, :]
        tl.store(dst, acc, mask=ok_t[:, None] & ok_e[None, :])

    @triton.jit
    def _topk_softmax_kernel(part_ptr, top_ptr, gate_ptr, n, E, SPLITS: tl.constexpr, K: tl.constexpr,
                             K_PAD: tl.constexpr, E_PAD: tl.constexpr, BT: tl.constexpr, INTERPRET: tl.constexpr):
        """BT tokens: logits = the partials summed in split order; k rounds of (largest, lowest
        index among equals; NaN counts as largest, as in torch.topk); softmax over the k."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        ok_t = rows < n
        experts = tl.arange(0, E_PAD)
        ok = ok_t[:, None] & (experts < E)[None, :]
        at = rows[:, None].to(tl.int64) * E + experts[None, :]
        logits = tl.zeros([BT, E_PAD], dtype=tl.float32)
        for z in range(0, SPLITS):
            logits += tl.load(part_ptr + z * n * E + at, mask=ok, other=0.0)
        key = tl.where(ok, tl.where(logits != logits, float("inf"), logits), -float("inf"))
        j = tl.arange(0, K_PAD)
        top = tl.zeros([BT, K_PAD], dtype=tl.int32)
        vals = tl.full([BT, K_PAD], -float("inf"), dtype=tl.float32)
        for r in tl.static_range(K):
            best = tl.max(key, 1)
            idx = tl.min(tl.where(key == best[:, None], experts[None, :], E_PAD), 1)
            hit = experts[None, :] == idx[:, None]
            top = tl.where(j[None, :] == r, idx[:, None], top)
            vals = tl.where(j[None, :] == r, tl.sum(tl.where(hit, logits, 0.0), 1)[:, None], vals)
            key = tl.where(hit, -float("inf"), key)
        ex = _exp(vals - tl.max(vals, 1)[:, None], INTERPRET)  # the first is the largest (or NaN)
        gate = tl.div_rn(ex, tl.sum(ex, 1)[:, None])
        out = rows[:, None].to(tl.int64) * K + j[None, :]
        keep = ok_t[:, None] & (j < K)[None, :]
        tl.store(top_ptr + out, top.to(tl.int64), mask=keep)
        tl.store(gate_ptr + out, gate, mask=keep)

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
