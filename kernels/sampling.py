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

`sample_tempered` is the RL default (temperature only, the full distribution) in one pass over
the logits as the model wrote them: the token, and its log-probability from a running
log-sum-exp. Unfused, a decode step at Qwen3's vocabulary makes five passes over [B, V] (the
float copy, the division, the draw, log_softmax and its gather) and the draw runs one program a
row, fewer than the GPU's multiprocessors; here each row is split over several programs and a
second launch joins the pieces. It has run in the Triton interpreter only so far: the engine
keeps the unfused passes until `bench/sampling.py` and the GPU tests have run it on a GPU.
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
# sample_tempered's split kernel: 2048 entries a step over 4 warps compile (Triton 3.6, sm_90) to
# 96-111 registers a thread, 4-5 programs an SM; 4096 took up to 249, 2 programs (8 warps) an SM
# (tests/support/compile_sm90.py reports them without a GPU)
SPLIT_BLOCK, SPLIT_WARPS = 2048, 4
SPLIT_PROGRAMS = 1024  # programs `sample_tempered` aims for: a few waves on an H100's 132 multiprocessors


def _streams_on(x: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, name: str):
    """keys and steps (int64 [B]) checked against x [B, V] and moved to x's device. Raises
    ValueError naming `name` for shapes that do not fit, keys outside 32 bits or negative steps."""
    if x.dim() != 2 or keys.shape != (x.shape[0],) or steps.shape != (x.shape[0],):
        raise ValueError(f"{name}: x [B, V] with keys and steps [B], got {tuple(x.shape)}, "
                         f"{tuple(keys.shape)}, {tuple(steps.shape)}")
    if bool(((keys < 0) | (keys > MASK32)).any()) or bool((steps < 0).any()):  # where they are: pass host tensors
        raise ValueError(f"{name}: keys must be 32-bit and steps >= 0")
    if x.is_cuda:  # from pinned memory: a plain copy from pageable memory waits for the device's queue
        return tuple(t.to(x.device, torch.int64) if t.is_cuda else
                     t.to(torch.int64).pin_memory().to(x.device, non_blocking=True) for t in (keys, steps))
    return keys.to(x.device, torch.int64), steps.to(x.device, torch.int64)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """One token per row of x, drawn from softmax(x[b]) with row b's stream (keys[b], steps[b]).

    Raises ValueError for shapes that do not fit or keys outside 32 bits.
    """
    keys, steps = _streams_on(x, keys, steps, "gumbel_argmax")
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


def sample_tempered(logits: torch.Tensor, temperature: float, keys: torch.Tensor, steps: torch.Tensor, *,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row drawn from softmax(x / temperature), x = logits.float() ([B, V], any float
    dtype), with row b's stream (keys[b], steps[b]) as `gumbel_argmax` draws it, and its
    log-probability under that distribution: (tokens int64 [B], log-probabilities float32 [B]).
    The tokens are `gumbel_argmax(x / temperature)`'s; the log-probabilities match log_softmax's
    to float32 rounding, and are NaN for rows whose logits hold NaN.

    Raises ValueError for temperature <= 0 (greedy is an argmax), shapes that do not fit, or
    keys outside 32 bits.
    """
    if not temperature > 0:
        raise ValueError(f"sample_tempered: temperature must be > 0, got {temperature}")
    keys, steps = _streams_on(logits, keys, steps, "sample_tempered")
    if not _use_triton(logits, backend):
        scaled = logits.float() / temperature
        tokens = gumbel_argmax(scaled, keys, steps, backend="torch")
        return tokens, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0]
    if logits.shape[1] >= 2**24:  # token ids travel through float32 partials
        raise ValueError(f"sample_tempered: a vocabulary of {logits.shape[1]} is over 2**24")
    logits = logits.contiguous()
    b, v = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logps = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logps
    block = min(SPLIT_BLOCK, triton.next_power_of_2(v))
    splits = max(1, min(triton.cdiv(v, block), triton.cdiv(SPLIT_PROGRAMS, b)))
    chunk = triton.cdiv(triton.cdiv(v, splits), block) * block  # a whole number of loop steps a program
    splits = triton.cdiv(v, chunk)
    part = torch.empty(5, b, splits, dtype=torch.float32, device=logits.device)  # score, index, max, sum, NaN
    _sample_split_kernel[(b, splits)](logits, keys, steps, part, float(temperature), splits, V=v, CHUNK=chunk,
                                      BLOCK=block, SCALE=temperature != 1.0, num_warps=SPLIT_WARPS)
    _sample_join_kernel[(b,)](logits, part, tokens, logps, float(temperature), splits, V=v,
                              SPLITS=triton.next_power_of_2(splits), SCALE=temperature != 1.0)
    return tokens, logps


if triton is not None:

    @triton.jit
    def _tempered(logit, t, SCALE: tl.constexpr):
        """float32(logit) / t, rounded as torch divides (the division skipped when t is 1)."""
        x = logit.to(tl.float32)
        if SCALE:
            x = tl.math.div_rn(x, t)
        return x

    @triton.jit
    def _sample_split_kernel(logits_ptr, keys_ptr, steps_ptr, part_ptr, t, splits, V: tl.constexpr,
                             CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr):
        """Program (b, s), vocabulary [s * CHUNK, + CHUNK) of row b: the best Gumbel score and its
        first index (as `_gumbel_argmax_kernel`), the largest tempered logit m, sum(exp(x - m)),
        and whether a logit is NaN, to part[0..4, b, s]."""
        b = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        base = tl.load(steps_ptr + b) * V
        best = -float("inf")
        best_idx = tl.zeros((), dtype=tl.int64)
        m = -float("inf")
        total = 0.0
        nan = 0.0
        for off in range(0, CHUNK, BLOCK):
            v = s * CHUNK + off + tl.arange(0, BLOCK)
            ok = v < V
            x = tl.where(ok, _tempered(tl.load(logits_ptr + b * V + v, mask=ok, other=0.0), t, SCALE), -float("inf"))
            u = _uniform(base + v, key)
            score = tl.where(ok, x - tl.log(-tl.log(u)), -float("inf"))
            top = tl.max(score, 0)
            i = tl.argmax(score, 0).to(tl.int64) + s * CHUNK + off
            take = top > best  # strict: an earlier block keeps a tie
            best_idx = tl.where(take, i, best_idx)
            best = tl.where(take, top, best)
            nan = tl.maximum(nan, tl.max((x != x).to(tl.float32), 0))
            m_new = tl.maximum(m, tl.max(x, 0))
            finite = m_new > -float("inf")  # all -inf so far: nothing to add
            total = tl.where(finite, total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0), 0.0)
            m = m_new
        at = part_ptr + b * splits + s
        rows = tl.num_programs(0).to(tl.int64) * splits
        tl.store(at, best)
        tl.store(at + rows, best_idx.to(tl.float32))  # < 2**24: exact
        tl.store(at + 2 * rows, m)
        tl.store(at + 3 * rows, total)
        tl.store(at + 4 * rows, nan)

    @triton.jit
    def _sample_join_kernel(logits_ptr, part_ptr, tokens_ptr, logps_ptr, t, splits, V: tl.constexpr,
                            SPLITS: tl.constexpr, SCALE: tl.constexpr):
        """Row b: the token of the best split (the first on ties, so the lowest index, as one
        program over the row would pick) and x[token] - log(sum over splits of total * exp(m - M)) - M."""
        b = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SPLITS)
        ok = s < splits
        rows = tl.num_programs(0).to(tl.int64) * splits
        at = part_ptr + b * splits + s
        score = tl.load(at, mask=ok, other=-float("inf"))
        index = tl.load(at + rows, mask=ok, other=0.0)
        m = tl.load(at + 2 * rows, mask=ok, other=-float("inf"))
        total = tl.load(at + 3 * rows, mask=ok, other=0.0)
        nan = tl.max(tl.load(at + 4 * rows, mask=ok, other=0.0), 0)
        first = tl.argmax(score, 0)  # the lowest split among equal scores
        token = tl.sum(tl.where(s == first, index, 0.0), 0).to(tl.int64)
        top = tl.max(m, 0)
        log_z = top + tl.log(tl.sum(tl.where(m > -float("inf"), total * tl.exp(m - top), 0.0), 0))
        x = _tempered(tl.load(logits_ptr + b * V + token), t, SCALE)
        tl.store(tokens_ptr + b, token)
        tl.store(logps_ptr + b, tl.where(nan > 0, float("nan"), x - log_z))


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
