"""Batched token sampling by the Gumbel-max trick, with a counter-based random stream per row.

argmax_v(x_v + G_v), with G_v = -log(-log(u_v)) standard Gumbel noise, is a sample from
softmax(x); tokens masked to -inf never win. Each row draws u_v from `uniform_from_counter`
(fp4/rng.py) at index step * V + v under its own 32-bit key, so a row's token depends on its
key, its step and its logits only: not on the batch around it, the device or the launch grid.

The Triton kernel (one program per row, the vocabulary in chunks) and the torch path compute
the same uniforms bit for bit; the logarithms may differ in the last place, which can only
change a token where two candidates tie to within that.

Shapes: x float32 [B, V] (logits already scaled by 1 / temperature and masked), keys int64 [B]
(32-bit values), steps int64 [B]; tokens int64 [B].
"""

from __future__ import annotations

import torch

from .fp4.api import _use_triton
from .fp4.rng import MASK32, uniform_from_counter

try:
    import triton
    import triton.language as tl

    from .fp4.triton_fp4 import _uniform
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None

BLOCK_V = 4096  # vocabulary entries per loop step of the Triton kernel


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """One token per row of x, drawn from softmax(x[b]) with row b's stream (keys[b], steps[b]).

    Raises ValueError for shapes that do not fit or keys outside 32 bits.
    """
    if x.dim() != 2 or keys.shape != (x.shape[0],) or steps.shape != (x.shape[0],):
        raise ValueError(f"gumbel_argmax: x [B, V] with keys and steps [B], got {tuple(x.shape)}, "
                         f"{tuple(keys.shape)}, {tuple(steps.shape)}")
    if bool(((keys < 0) | (keys > MASK32)).any()) or bool((steps < 0).any()):  # where they are: pass host tensors
        raise ValueError("gumbel_argmax: keys must be 32-bit and steps >= 0")
    if x.is_cuda:  # from pinned memory: a plain copy from pageable memory waits for the device's queue
        keys, steps = (t.to(x.device, torch.int64) if t.is_cuda else
                       t.to(torch.int64).pin_memory().to(x.device, non_blocking=True) for t in (keys, steps))
    else:
        keys, steps = keys.to(x.device, torch.int64), steps.to(x.device, torch.int64)
    x = x.float().contiguous()
    b, v = x.shape
    if not _use_triton(x, backend):
        index = steps[:, None] * v + torch.arange(v, device=x.device)[None]
        u = uniform_from_counter(index, keys[:, None])
        return (x - torch.log(-torch.log(u))).argmax(-1)
    tokens = torch.empty(b, dtype=torch.int64, device=x.device)
    if b:
        _gumbel_argmax_kernel[(b,)](x, keys, steps, tokens, v, BLOCK=min(BLOCK_V, triton.next_power_of_2(v)))
    return tokens


if triton is not None:

    @triton.jit
    def _gumbel_argmax_kernel(x_ptr, keys_ptr, steps_ptr, out_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
        """Row b: argmax over v of x[b, v] - log(-log(u)), the first index on ties (as torch). V is
        a compile-time constant: one vocabulary per model, and Triton 3.6's interpreter needs a
        Python loop bound."""
        b = tl.program_id(0).to(tl.int64)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        base = tl.load(steps_ptr + b) * V
        best = -float("inf")
        best_idx = tl.zeros((), dtype=tl.int64)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            ok = v < V
            x = tl.load(x_ptr + b * V + v, mask=ok, other=-float("inf"))
            u = _uniform(base + v, key)
            score = tl.where(ok, x - tl.log(-tl.log(u)), -float("inf"))
            m = tl.max(score, 0)
            i = tl.argmax(score, 0).to(tl.int64) + v0
            take = m > best  # strict: an earlier chunk keeps a tie
            best_idx = tl.where(take, i, best_idx)
            best = tl.where(take, m, best)
        tl.store(out_ptr + b, best_idx)
