"""Causal self-attention over packed sequences (THD: the tokens of many sequences one after
another, `cu` their boundaries), shared by the Megatron trainer's core attention and the
DeepSpeed trainer's: the same batching, so the same values to the last bit."""

from __future__ import annotations

import functools
import inspect
import warnings
from itertools import pairwise

import torch
import torch.nn.functional as F


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: list[int],
                            scale: float | None) -> torch.Tensor:
    """query / key [T, heads, d] / [T, kv_heads, d] (GQA), value [T, kv_heads, dv] (MLA: dv != d),
    `cu` the sequences' boundaries (cu[0] = 0, cu[-1] <= T); returns [T, heads * dv] in query's
    dtype, each sequence attending causally to itself only (rows after cu[-1] are zero).

    THD attention in a few batched calls: RL and SFT packs hold hundreds of short
    sequences of many lengths, and a call per sequence (or per distinct length: ~35 per
    layer in an RL step, 4.5 s of a 12-layer model's step on an H200) costs far more in
    launches than in math. Sequences are grouped by length class and right-padded to its
    power-of-two width: causal masking keeps every real query from the padding after it, so
    each sequence still attends exactly to itself; the padded rows' outputs are dropped
    (their gradients are zero). On a GPU with torch's flash-attention varlen kernel
    (`torch.nn.attention.varlen`) the pack goes to it as it is: no padding, no gathers."""
    if _varlen_fits(query, key, value):
        return _varlen_causal_attention(query, key, value, cu, scale)
    groups, keep, dest = attention_groups(tuple(cu), query.device)
    if not groups:
        return query.new_zeros(query.shape[0], query.shape[1] * value.shape[2])
    outs = []
    for idx in groups:  # [sequences, width]
        q, k, v = (t[idx.reshape(-1)].unflatten(0, idx.shape).transpose(1, 2) for t in (query, key, value))
        outs.append(causal_sdpa(q, k, v, scale).transpose(1, 2).flatten(0, 1))  # [n * width, heads, d]
    # tokens after the last sequence (padding) attend to nothing: zeros
    out = query.new_zeros(*query.shape[:2], value.shape[2]).index_copy(0, dest, torch.cat(outs).index_select(0, keep))
    return out.reshape(query.shape[0], -1)


@functools.cache
def _varlen_options() -> dict | None:
    """Keyword arguments that make this torch's `varlen_attn` causal, batch invariant and GQA-aware
    (its signature changed across torch releases), or None without one that can."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params or "enable_gqa" not in params:
        return None
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True} if "is_causal" in params \
        else None
    # one split: a sequence's values do not depend on what else is in the pack
    return None if causal is None else causal | ({"num_splits": 1} if "num_splits" in params else {})


def _varlen_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether flash attention's varlen kernel takes these: CUDA, half precision, one head width
    for q, k and v (MLA's differ) of at most 256, and a kernel that ran forward and backward on
    this device (`_varlen_runs`)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_options() is not None
            and query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256
            and _varlen_runs(query.device, query.dtype, query.shape[-1]))


@functools.cache
def _varlen_runs(device, dtype, head_dim: int) -> bool:
    """One tiny GQA pack of two sequences through varlen_attn, forward and backward, once per
    device, dtype and head width: where this torch's kernel refuses it (a build without flash
    attention, an architecture it lacks), the padded path runs instead, with a warning."""
    try:  # the first call may come from a no-grad or inference-mode forward (log-probs)
        with torch.inference_mode(False), torch.enable_grad():
            q, k, v = (torch.randn(6, h, head_dim, device=device, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
            _varlen_causal_attention(q, k, v, [0, 2, 5], None).float().sum().backward()
        return True
    except RuntimeError as err:
        warnings.warn(f"torch's varlen flash attention did not run here ({err}); packed attention pads "
                      "sequences by length class instead", stacklevel=2)
        return False


def _varlen_causal_attention(query, key, value, cu: list[int], scale: float | None) -> torch.Tensor:
    """`packed_causal_attention` through torch's varlen flash attention: [T, heads * d]."""
    from torch.nn.attention.varlen import varlen_attn

    bounds, longest = _varlen_bounds(tuple(cu), query.device)
    n = cu[-1]
    if bounds.numel() == 1:  # no sequence
        return query.new_zeros(query.shape[0], query.shape[1] * value.shape[2])
    out = varlen_attn(query[:n], key[:n], value[:n], bounds, bounds, longest, longest, scale=scale,
                      enable_gqa=key.shape[1] != query.shape[1], **_varlen_options())
    if n < query.shape[0]:  # tokens after the last sequence (padding) attend to nothing: zeros
        out = torch.cat([out, out.new_zeros(query.shape[0] - n, *out.shape[1:])])
    return out.reshape(query.shape[0], -1)


@functools.lru_cache(maxsize=8)
def _varlen_bounds(cu: tuple[int, ...], device) -> tuple[torch.Tensor, int]:
    """The pack's sequence boundaries int32 [n + 1] on `device` (empty sequences dropped) and the
    longest sequence's length."""
    kept = [cu[0]] + [hi for lo, hi in pairwise(cu) if hi > lo]
    longest = max((hi - lo for lo, hi in pairwise(kept)), default=1)
    return torch.tensor(kept, dtype=torch.int32, device=device), longest


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of q [B, heads, S, d] over k, v [B, kv_heads, S, d] (GQA): [B, heads, S, d]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


@functools.lru_cache(maxsize=8)
def attention_groups(cu: tuple[int, ...], device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """How `packed_causal_attention` batches the sequences of a pack (cached like `packed_positions`):
    per length class, the token index of each (sequence, slot) int64 [n, width] (slots past a
    sequence's end repeat its last token); `keep`, the flat (sequence, slot) positions of real
    tokens over the groups' outputs in order; `dest`, those tokens' rows in the pack. Index
    lists, not boolean masks: a mask's indexing would wait for the GPU."""
    classes: dict[int, list[tuple[int, int]]] = {}
    for lo, hi in pairwise(cu):
        if hi > lo:
            classes.setdefault((hi - lo - 1).bit_length(), []).append((lo, hi - lo))
    groups, keep, dest, offset = [], [], [], 0
    for length_class, members in classes.items():
        # the class's width, not its longest member's: a sequence's padding, and so its values
        # to the last bit, do not depend on what else is in the pack (layouts pack differently)
        width = 1 << length_class
        for i, (lo, n) in enumerate(members):
            keep.extend(range(offset + i * width, offset + i * width + n))
            dest.extend(range(lo, lo + n))
        slots = torch.arange(width)
        starts, lengths = (torch.tensor(x) for x in zip(*members, strict=True))
        groups.append((starts[:, None] + torch.minimum(slots, lengths[:, None] - 1)).to(device))
        offset += len(members) * width
    as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return groups, as_index(keep), as_index(dest)


@functools.lru_cache(maxsize=8)
def packed_positions(cu: tuple[int, ...], tokens: int, device) -> torch.Tensor:
    """int64 [tokens] on `device`: each token's position in its packed sequence (0 after the last
    one). Cached: every layer of a micro-batch's forward and recompute asks for the same."""
    lengths = torch.tensor([hi - lo for lo, hi in pairwise(cu)], dtype=torch.long)
    pos = torch.zeros(tokens, dtype=torch.long)
    pos[:cu[-1]] = torch.arange(cu[-1]) - torch.repeat_interleave(torch.tensor(cu[:-1], dtype=torch.long), lengths)
    return pos.to(device)
