"""Guidance capture inside SGLang's scheduler processes: how the FP4 sites rounded, per token.

Modelled on SGLang's routed-experts capturer: for the layers the policy selects, each forward's
rows (mantissa bits, E4M3 block scale bytes and the row's global scale, what a dense record
keeps; for the sparse coding also the near-boundary mask, and with its "near" scale coding the
marked scales: `guidance.sparse_parts_of_dense`) are written into host buffers indexed by KV
slot, so they follow radix/prefix sharing. An eager forward keeps its rows on the device until
it ends, then every site's go to the host in one copy. A finished request's rows are gathered
by its slots (`collect`). The engine takes them in bulk, once per `generate`, through a file
per tensor-parallel rank (`dump`, called over SGLang's RPC), never through the per-step messages.

Decode steps that replay a CUDA graph run no Python: while SGLang captures a decode graph
(`graph_capture`), the rows go in token order into device staging buffers that every graph
shares (as SGLang's routed-experts capturer does), and after each replay `file_staged` files the
real tokens' rows by slot. Prefill runs eager (the engine turns SGLang's prefill graphs off).

Each rank records what it computes: whole rows for qkv and fc1 (their inputs are replicated),
its column slice for proj and fc2 (row-parallel inputs; the row's global scale is all-reduced,
so it is the same on every rank), its KV heads for k and v. `merge_ranks` puts the slices
together again. Shapes: T tokens of the forward, per = rows per token of a site (1; KV heads for
k/v; top-k for fc2), R = T * per rows.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from megatron_trace.guidance import sparse_parts_of_dense

# JSON {"layers": [...], "coding": "dense" | "sparse", "tau", "scale_coding"} the engine sets for its
# scheduler processes
ENV = "TRACE_SGLANG_CAPTURE"
# requests whose guidance rows are kept: a sample's own (every token it ran) and its feed (the last token)
SAMPLE_PREFIX, FEED_PREFIX = "trace/", "trace-feed/"
# guidance.record.SITES: Qwen3-MoE's, and the DeepSeek-V3 family's q_up, kv (the MLA latent) and
# shared_fc2 (a model records those it has)
SITES = ("qkv", "q_up", "kv", "proj", "fc1", "fc2", "shared_fc2", "k", "v")
# how TP splits a site's rows (the rest are replicated: whole rows on every rank)
SLICED = {"proj": "cols", "fc2": "cols", "shared_fc2": "cols", "k": "heads", "v": "heads"}

_policy: frozenset = frozenset()  # (layer, site) pairs captured in this process
_sparse: dict | None = None  # {"tau", "scale_coding"} for the sparse coding (None: dense)
_layer: int | None = None  # the layer whose K/V the KV pool is writing
_slots: torch.Tensor | None = None  # KV slots [T] of the forward's tokens, where SGLang keeps them
_slots_host: torch.Tensor | None = None  # the same int64 on the host, copied at the first row filed
_capacity = 0  # KV slots in the pool
_buffers: dict = {}  # (layer, site) -> (bits, scales, g) host buffers [capacity * per, ...]
_graph: tuple[int, int] | None = None  # (tokens, most tokens of any graph) of the decode graph being captured
_staging: dict = {}  # (layer, site) -> (per, device parts [most graph tokens * per, ...]) decode graphs write
_taken: dict = {}  # request id -> {(layer, site): (bits, scales, g)} gathered at its finish
_pending: list = []  # [(layer, site, per, device parts)] of the eager forward, filed at its end
_pending_bytes = 0  # their size, kept as they come (a sum over every part at every site would grow quadratically)
# ... or sooner, once they hold this many bytes: a prefill chunk of 8192 tokens with guidance of
# every layer of Qwen3-30B-A3B records about 1.2 GB, which SGLang's memory budget does not hold
PENDING_BYTES = 256 << 20
_pinned: torch.Tensor | None = None  # page-locked host bytes the one copy per forward lands in, reused


def configure_from_env() -> None:
    """Capture what the engine asked for in TRACE_SGLANG_CAPTURE (nothing when it is unset)."""
    spec = json.loads(os.environ.get(ENV) or "{}")
    sparse = ({"tau": spec["tau"], "scale_coding": spec["scale_coding"]} if spec.get("coding") == "sparse"
              else None)
    configure(((layer, site) for layer in spec.get("layers", ()) for site in SITES), sparse)


def configure(pairs, sparse: dict | None = None) -> None:
    """Capture the (layer, site) pairs `pairs` from now on (empty: none), in the dense coding's
    parts or, with `sparse` ({"tau", "scale_coding"}), the sparse coding's."""
    global _policy, _sparse
    _policy, _sparse = frozenset(pairs), sparse
    _buffers.clear()
    _staging.clear()


def active() -> bool:
    return bool(_policy)


@contextlib.contextmanager
def forward(slots: torch.Tensor, capacity: int):
    """The scope of one model forward whose tokens sit in KV slots `slots` int64 [T]."""
    global _slots, _slots_host, _capacity, _pending_bytes
    # copied to the host only when rows are filed: not before a graph replay is launched
    _slots, _slots_host, _capacity = slots, None, capacity
    _pending.clear()
    _pending_bytes = 0
    try:
        yield
        _file_pending()  # an eager forward's rows: every site's, in one copy to the host
    finally:
        _pending.clear()
        _pending_bytes = 0
        _slots = _slots_host = None


@contextlib.contextmanager
def at_layer(layer: int):
    """Within this scope, K/V writes belong to `layer` (SGLang's KV methods are not told)."""
    global _layer
    outer, _layer = _layer, layer
    try:
        yield
    finally:
        _layer = outer


@contextlib.contextmanager
def graph_capture(tokens: int, max_tokens: int):
    """The scope of SGLang's warm-up and capture of one decode CUDA graph for `tokens` tokens
    (padding included; `max_tokens`: the most of any graph the engine captures). The rows go to
    the device staging buffers instead of the host (`file_staged` after each replay)."""
    global _graph
    if tokens > max_tokens:
        raise ValueError(f"guidance capture: a decode graph of {tokens} tokens, "
                         f"more than the {max_tokens} of its engine")
    outer, _graph = _graph, (tokens, max_tokens)
    try:
        yield
    finally:
        _graph = outer


def current_layer() -> int | None:
    return _layer


def wants(layer: int, site: str) -> bool:
    """True when the site's rows of the current forward are to be recorded."""
    return (_slots is not None or _graph is not None) and (layer, site) in _policy


def record(layer: int, site: str, x_RK: torch.Tensor, kept, order: torch.Tensor | None = None) -> None:
    """Store a site's rows x_RK of the current forward by KV slot (while a decode graph is being
    captured: in its staging buffers, token-major). kept: (bits [R, K/8], scales [R, K/16], g [R])
    in token-major row order, or in the order `order` int64 [R] gives (each row's token-major
    index: the experts' fc2 rows come sorted by expert). The sparse coding's parts are computed
    from them here, on the rows' device, with no host sync (graph capture allows none)."""
    global _pending_bytes
    tokens = _graph[0] if _graph is not None else _slots.numel()
    per = x_RK.shape[0] // max(1, tokens)
    if per * tokens != x_RK.shape[0]:
        raise ValueError(f"guidance capture: layer {layer} {site}: {x_RK.shape[0]} rows for {tokens} tokens")
    if _sparse is not None:
        kept = sparse_parts_of_dense(x_RK, *kept, tau=_sparse["tau"], scale_coding=_sparse["scale_coding"])
    parts = [t.detach() for t in kept]
    if order is not None:
        dest = torch.empty_like(order)
        dest[order] = torch.arange(order.numel(), device=order.device)
        parts = [p[dest.to(p.device)] for p in parts]
    if _graph is None:  # filed when the forward ends, with the other sites' rows
        _pending.append((layer, site, per, parts))
        _pending_bytes += sum(p.numel() * p.element_size() for p in parts)
        if _pending_bytes >= PENDING_BYTES:
            _file_pending()
        return
    staged = _staging.get((layer, site))
    if staged is None:  # allocated once, for the engine's largest graph: every graph writes here
        staged = _staging[(layer, site)] = (per, tuple(p.new_empty((_graph[1] * per, *p.shape[1:])) for p in parts))
    for buf, part in zip(staged[1], parts, strict=True):
        buf[:part.shape[0]].copy_(part)


def file_staged() -> None:
    """After a decode graph's replay (within `forward`): file its real tokens' rows, the first
    T * per of each staging buffer, by their KV slots."""
    if not _staging:  # (the policy names every site; a model records those it has)
        raise RuntimeError("guidance capture: a decode CUDA graph ran that recorded no rows "
                           "(captured without TRACE's hook around SGLang's graph capture)")
    unpacked = _to_host([b[:_slots.numel() * per] for per, bufs in _staging.values() for b in bufs])
    for (layer, site), (per, bufs) in _staging.items():
        _file(layer, site, per, unpacked[:len(bufs)])
        unpacked = unpacked[len(bufs):]


def _file_pending() -> None:
    """File the eager forward's rows recorded so far, by one copy to the host."""
    global _pending_bytes
    filed = list(_pending)
    _pending.clear()
    _pending_bytes = 0
    hosted = _to_host([p for *_, parts in filed for p in parts])
    for layer, site, per, parts in filed:
        _file(layer, site, per, hosted[:len(parts)])
        hosted = hosted[len(parts):]


def _to_host(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same tensors on the host, by one device-to-host copy of them all (a copy each is a
    sync each: ~2 ms a decode step, 144 per prefill chunk at 8 guided layers), into page-locked
    memory on a GPU. Each part starts 16-byte aligned, so that it can be viewed as its dtype.
    The results are views of a reused buffer: file them before the next call."""
    global _pinned
    if not parts:
        return []
    pieces, spans, at = [], [], 0
    for t in parts:
        raw = t.reshape(-1).view(torch.uint8)
        spans.append((at, raw.numel()))
        pad = -raw.numel() % 16
        pieces += [raw, raw.new_zeros(pad)] if pad else [raw]
        at += raw.numel() + pad
    flat = torch.cat(pieces)
    if flat.is_cuda:
        if _pinned is None or _pinned.numel() < flat.numel():
            _pinned = torch.empty(max(flat.numel(), 2 * (0 if _pinned is None else _pinned.numel())),
                                  dtype=torch.uint8, pin_memory=True)
        host = _pinned[:flat.numel()]
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
    else:
        host = flat
    return [host[lo:lo + size].view(t.dtype).reshape(t.shape) for (lo, size), t in zip(spans, parts, strict=True)]


def _file(layer: int, site: str, per: int, parts: list[torch.Tensor]) -> None:
    """Write host rows [T * per, ...] of the current forward's tokens into the site's host buffers."""
    global _slots_host
    store = _buffers.get((layer, site))
    if store is None or store[0].shape[0] != _capacity * per:
        store = _buffers[(layer, site)] = tuple(p.new_zeros((_capacity * per, *p.shape[1:])) for p in parts)
    if _slots_host is None:
        _slots_host = _slots.to("cpu", torch.long)
    rows = (_slots_host[:, None] * per + torch.arange(per)).reshape(-1)
    for buf, part in zip(store, parts, strict=True):
        buf.index_copy_(0, rows, part)  # (a forward's slots are distinct)


def collect(rid: str, slots: torch.Tensor) -> None:
    """Gather a finished request's rows (its tokens' KV slots int64 [n], in token order): all of
    a sample's, the last token's of a feed."""
    if not rid.startswith((SAMPLE_PREFIX, FEED_PREFIX)) or not _buffers:
        return
    slots = slots.to("cpu", torch.long)
    if rid.startswith(FEED_PREFIX):
        slots = slots[-1:]
    out = {}
    for (layer, site), store in _buffers.items():
        per = store[0].shape[0] // _capacity
        rows = (slots[:, None] * per + torch.arange(per)).reshape(-1)
        out[(layer, site)] = tuple(buf[rows].clone() for buf in store)
    _taken[rid] = out


def dump(rids: list[str], path: str, rank: int) -> None:
    """Write the gathered rows of `rids` to path/rank<rank>.pt (atomically) and forget them;
    a request without rows is an error naming it."""
    missing = [r for r in rids if r not in _taken]
    if missing:
        raise KeyError(f"guidance capture: no rows were gathered for requests {missing[:3]}")
    data = {r: _taken.pop(r) for r in rids}
    final = Path(path) / f"rank{rank}.pt"
    tmp = final.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(final)


def merge_ranks(per_rank: list[dict], heads: int, ep_size: int = 1, experts: dict | None = None,
                num_experts: int = 0, dense_layers: frozenset = frozenset()) -> dict:
    """One request's {(layer, site): parts} of every TP rank (in rank order; the dense coding's
    (bits, scales, g) or the sparse coding's longer tuple, g third, every other part with a
    row's columns along dim 1) as the whole rows an unsharded engine would have captured
    (heads: KV heads in all). Under SGLang's
    expert parallelism (ep_size > 1: rank r is moe-TP rank r % (tp / ep) of EP rank
    r // (tp / ep)) each fc2 row (token, slot) is taken from the EP rank holding the expert it was
    routed to: experts {layer: global expert ids int64 [tokens, k]} of num_experts in all;
    dense_layers (a dense FFN, no experts) have their fc2 split over every rank's columns."""
    if len(per_rank) == 1:
        return per_rank[0]
    moe_tp = len(per_rank) // ep_size
    out = {}
    for key, first in per_rank[0].items():
        layer, site = key
        parts = [r[key] for r in per_rank]
        if site == "fc2" and ep_size > 1 and layer not in dense_layers:  # (a dense layer's fc2: TP columns)
            if experts is None or layer not in experts:
                raise ValueError(f"guidance merge: layer {layer} fc2 under EP {ep_size} needs its routed experts")
            groups = [_join_cols(parts[e * moe_tp:(e + 1) * moe_tp]) for e in range(ep_size)]
            owner = experts[layer].reshape(-1) // (num_experts // ep_size)
            rows = torch.arange(owner.numel())
            out[key] = tuple(torch.stack([grp[i] for grp in groups])[owner, rows] for i in range(len(first)))
        elif SLICED.get(site) == "cols":  # each rank its columns; g is the same everywhere
            out[key] = _join_cols(parts)
        elif SLICED.get(site) == "heads":  # each rank its KV heads, rows (token, head)
            local = heads // len(parts)

            def join(i, parts=parts, local=local):
                return torch.cat([p[i].reshape(-1, local, *p[i].shape[1:]) for p in parts], 1).flatten(0, 1)
            out[key] = tuple(join(i) for i in range(len(first)))
        else:
            out[key] = first
    return out


def _join_cols(parts: list[tuple]) -> tuple:
    """Column slices of the same rows (every part but g, the third, the same in each) as whole rows."""
    return tuple(parts[0][i] if i == 2 else torch.cat([p[i] for p in parts], 1) for i in range(len(parts[0])))
