"""FP4 fake quantization at one site of the trainer (docs/design.md sections 2, 3 and 4.3).

An `FP4Site` is attached to every module that quantizes (the QKV and output projections,
each expert's fc1 and fc2, core attention's K and V). It knows what its rows are in the
micro-batch, so that in `trace` mode it can take the engine's guidance for exactly those rows,
and which process group holds the other column shards of its rows and weights, so that
sharded and unsharded quantization give the same bytes:

- weights: one global scale over the whole logical tensor, its amax all-reduced (MAX) over the
  tensor- (or expert-tensor-) parallel group;
- activations: one global scale per row, the row amax all-reduced over the group whose ranks
  hold the other columns (row-parallel inputs), or taken from the guidance.

Forward values are FP4 grid values in the input dtype; the backward is straight-through with
zero gradient where an element was clipped (`trace_kernels.fp4.fake_quantize`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from trace_kernels.fp4 import (
    ClipMask,
    QTensor,
    amax,
    fake_quantize,
    fake_quantize_ste_flagged,
    quantize,
    quantize_guided,
)

from ..guidance.codec import GuidanceFormatError
from ..guidance.rows import RowGuidance
from ..modes import TrainerPrecision
from . import context


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """t (an amax, float32), in place, maximised over `group` (None or one rank: unchanged)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def _sharded(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _row_amax(x_RK: torch.Tensor, group) -> torch.Tensor | None:
    """Each row's amax [R, 1], all-reduced over `group`; None when no other rank holds columns of
    the rows: the quantizer then takes each row's own amax (on the GPU, inside its kernel)."""
    return all_reduce_max(amax(x_RK, -1, keepdim=True), group) if _sharded(group) else None


def _expert_amax(w_ENK: torch.Tensor, group) -> torch.Tensor:
    return all_reduce_max(amax(w_ENK, (1, 2)).reshape(-1, 1), group)


def fake_quant_expert_weights(w_ENK: torch.Tensor, group=None) -> torch.Tensor:
    """NVFP4 fake quant of stacked expert weights [E, N, K]: one global scale per expert, over
    its whole logical tensor (amax all-reduced over `group`). Returns w's shape and dtype."""
    e = w_ENK.shape[0]
    # a row per expert: its 16-element blocks are the same blocks as along K (K % 16 == 0)
    return fake_quantize(w_ENK.reshape(e, -1), "nvfp4", scale="row", global_amax=_expert_amax(w_ENK, group),
                         check_finite=False).reshape(w_ENK.shape)


# -- weights that stay fixed across the micro-batches of one optimizer step ------------------
_weight_cache: dict | None = None


@contextlib.contextmanager
def cached_weights():
    """Within this scope the weights do not change (the micro-batches between two optimizer
    steps), so each weight's FP4 fake quant is computed once and reused; gradients still flow
    to every parameter through the straight-through estimator. A parameter modified in place
    inside the scope (its version counter moves) is quantized again."""
    global _weight_cache
    outer, _weight_cache = _weight_cache, {}
    try:
        yield
    finally:
        _weight_cache = outer


def caching_weights() -> bool:
    """Whether a `cached_weights` scope is open."""
    return _weight_cache is not None


class _CachedSTE(torch.autograd.Function):
    """Returns a cached fake-quantized weight; backward: grad * mask to the parameter(s)
    (stacked along dim 0 when there are several), or grad as is where no element clipped."""

    @staticmethod
    def forward(ctx, w_q, mask, *params):
        ctx.mask = mask
        ctx.stacked = len(params) > 1
        return w_q.view_as(w_q)

    @staticmethod
    def backward(ctx, grad):
        # waits for the all-true answer: an event behind this weight's quantize, queued long before,
        # so the GPU's queue is not drained; nearly always true, sparing a pass over the gradient
        inside = ctx.mask.get(wait=True)
        g = grad if inside is None else grad * inside
        return (None, None, *(g.unbind(0) if ctx.stacked else (g,)))


def _memory_key(t: torch.Tensor) -> tuple:
    """What a tensor's values are: its memory and view, shared by the parameter and every alias of
    it (`w.detach()`, as TE's quantizers receive a weight). id() would not do: an alias is a new
    object, and a freed alias's id is soon another weight's. The first element's address stands
    for storage and offset (a third of the host time: a step asks for ~10^3 weights' keys)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _cached(params: list[torch.Tensor], compute, peers: tuple = (), each: bool = False):
    """compute(w, with_mask) -> (fake-quantized weight(s), STE mask or None, 0-d bool whether it is
    all true), w the parameter or the parameters stacked (`fake_quantize_ste_flagged`); cached.
    `peers`: other tensors the result depends on (a shared global scale's). `each`: slice i of a
    stacked result is also parameter i's own entry (one global scale per parameter, as
    `quantize_weight` gives it), so that a later call for one expert's weight (TE's grouped linear
    quantizes expert by expert) finds it."""
    tensors = (*params, *peers)
    key = tuple(_memory_key(t) for t in tensors)
    version = tuple(t._version for t in tensors)  # aliases share the parameter's version counter
    hit = _weight_cache.get(key)
    if hit is None or hit[0] != version:
        shape = (len(params), *params[0].shape) if len(params) > 1 else params[0].shape
        with torch.no_grad():
            w_q, _, all_inside = compute(_stacked(params), with_mask=False)

        def remake() -> torch.Tensor:
            if tuple(t._version for t in tensors) != version:
                raise RuntimeError("FP4 QAT: a weight changed in place between its forward and its backward; its "
                                   "straight-through mask can no longer be computed (step the optimizer after "
                                   "the backward)")
            with torch.no_grad():
                return compute(_stacked(params), with_mask=True)[1].reshape(shape)

        # a weight scaled by its own amax clips only in blocks of subnormal scale (under ~2^-15 of
        # its amax; `block_clip_bound`): the kernel answers whether any element clipped instead of
        # writing the mask (for Qwen3-30B-A3B's fc1 experts, 400 MB a layer), and the backward
        # hands the gradient on as is; the mask is computed only where the answer is no
        mask = ClipMask(None, all_inside=all_inside, remake=remake)
        # the entry holds the memory it is keyed on, so no other tensor gets that address inside
        # the scope (not even where a parameter's .data is swapped, as sharding frameworks do)
        held = tuple(t.untyped_storage() for t in tensors)
        hit = _weight_cache[key] = (version, w_q.reshape(shape), mask, held)
        if each and len(params) > 1 and not peers:
            for i, (p, p_q, p_held) in enumerate(zip(params, hit[1], held, strict=True)):
                _weight_cache[(_memory_key(p),)] = ((p._version,), p_q, mask.part(i), (p_held,))
    return _CachedSTE.apply(hit[1], hit[2], *params)


def _stacked(params: list[torch.Tensor]) -> torch.Tensor:
    return params[0] if len(params) == 1 else torch.stack(params)


def fake_quant_rows(x_RK: torch.Tensor, guidance: RowGuidance | None = None, group=None) -> torch.Tensor:
    """NVFP4 fake quant of activation rows [R, K] with one global scale per row.

    With `guidance`, the engine's scales and mantissa bits decide the codes; otherwise round to
    nearest, with each row's amax all-reduced over `group` (the ranks holding the row's other
    columns). Returns x's shape and dtype.
    """
    if guidance is not None:
        return guidance.fake_quantize(x_RK)
    return fake_quantize(x_RK, "nvfp4", scale="row", global_amax=_row_amax(x_RK, group), check_finite=False)


# Callables (site, x_RK, trainer QTensor, guidance rows or None) told about every quantized
# input; flip-rate metrics and tests use them. Computing the QTensor costs a second quantize.
observers: list = []


def quant_rows(x_RK: torch.Tensor, guidance: RowGuidance | None = None, group=None) -> QTensor:
    """The QTensor of `fake_quant_rows` (same arguments): codes, block scales and per-row global
    scales [R, 1] of the rows x_RK [R, K]; no autograd."""
    x = x_RK.detach()
    if guidance is not None:
        return quantize_guided(x, *guidance.resolve(x), check_finite=False)
    return quantize(x, "nvfp4", scale="row", global_amax=_row_amax(x, group), check_finite=False)


def _observe(site: FP4Site, x_RK: torch.Tensor, q: QTensor, guidance: RowGuidance | None) -> None:
    for fn in observers:
        fn(site, x_RK.detach(), q, guidance)


@dataclass
class Shard:
    """This rank's part of a dimension split evenly over `size` ranks."""

    rank: int = 0
    size: int = 1

    def span(self, total: int) -> tuple[int, int]:
        if total % self.size:
            raise GuidanceFormatError(f"{total} does not split evenly over {self.size} ranks")
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n


class SiteHolder:
    """A module that quantizes at one FP4 site, `fp4_site` (set by `model.attach_sites`): the
    local spec's FP4 linears, TRACE's TE linears, MLA's latent norm."""

    fp4_site: FP4Site | None = None


@dataclass(kw_only=True)
class FP4Site:
    """One FP4 site of one layer.

    name: "qkv", "proj", "fc1", "fc2", "k" or "v"; layer: 0-based global layer index.
    weight_group: the group over which the weight's amax is reduced (None: not sharded).
    row_group: the group holding the other columns of each input row (row-parallel inputs).
    tokens: the sequence-parallel shard of the micro-batch's tokens this rank's input holds.
    cols: the column shard of each guidance row this rank's input holds.
    heads: for k/v, the KV heads this rank holds.
    expert: for fc2 of one expert, its local expert index.
    all_experts: for fc2 of grouped experts: the rows of every local expert at once.
    quantizes_input: False for the experts' fc1, whose input is quantized per token before
        dispatch (the MoE layer's `fc1_input` site).
    weight_peers: weights quantized with this one as one logical tensor (MLA's query and KV down
        projections): the global scale is taken over all of them.
    """

    name: str
    layer: int
    precision: TrainerPrecision = TrainerPrecision.BF16
    weight_group: object = None
    row_group: object = None
    tokens: Shard | None = None
    cols: Shard | None = None
    heads: Shard | None = None
    expert: int | None = None
    all_experts: bool = False
    quantizes_input: bool = True
    weight_peers: tuple = ()

    @property
    def active(self) -> bool:
        return self.precision.quantizes

    def quantize_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Fake quant of this rank's weight shard [N, K] (global scale of the whole tensor)."""
        if not self.active:
            return w
        if _weight_cache is None:
            return fake_quantize(w, "nvfp4", scale="tensor", global_amax=self.weight_amax(w), check_finite=False)
        return _cached([w], lambda t, with_mask: fake_quantize_ste_flagged(
            t, "nvfp4", global_amax=self.weight_amax(t), check_finite=False, with_mask=with_mask), self.weight_peers)

    def weight_amax(self, w: torch.Tensor) -> torch.Tensor:
        """The amax of the whole logical tensor: over this shard, its peers' and the other shards."""
        m = amax(w)
        for peer in self.weight_peers:
            m = torch.maximum(m, amax(peer))
        return all_reduce_max(m, self.weight_group)

    def quantize_expert_weights(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """Fake quant of the local experts' weights (each [N, K]) stacked to [E, N, K], one global
        scale per expert (over its whole logical tensor: amax all-reduced over `weight_group`)."""
        if not self.active:
            return torch.stack(weights)
        if _weight_cache is None:
            return fake_quant_expert_weights(torch.stack(weights), self.weight_group)

        def compute(w_ENK, with_mask):
            return fake_quantize_ste_flagged(w_ENK.reshape(w_ENK.shape[0], -1), "nvfp4", scale="row",
                                             global_amax=_expert_amax(w_ENK, self.weight_group), check_finite=False,
                                             with_mask=with_mask)
        return _cached(list(weights), compute, each=True)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize x [..., K] row by row (a row is x's last dimension)."""
        if not self.active or not self.quantizes_input or x.numel() == 0:
            return x
        x_RK = x.reshape(-1, x.shape[-1])
        guidance = self._input_guidance(x_RK)
        if observers:
            _observe(self, x_RK, quant_rows(x_RK, guidance, self.row_group), guidance)
        return fake_quant_rows(x_RK, guidance, self.row_group).reshape(x.shape)

    def _input_guidance(self, x_RK: torch.Tensor) -> RowGuidance | None:
        return self.guidance_rows(x_RK) if self.precision is TrainerPrecision.FP4_GUIDED else None

    def weight_codes(self, w: torch.Tensor) -> QTensor:
        """The QTensor whose values `quantize_weight` gives for this rank's weight shard [N, K]
        (an active site: one global scale over the whole logical tensor)."""
        return quantize(w.detach(), "nvfp4", global_amax=self.weight_amax(w), check_finite=False)

    def input_codes(self, x_RK: torch.Tensor) -> QTensor:
        """The QTensor whose values `quantize_input` gives for rows x_RK [R, K] (an active site
        that quantizes its input), observers told as there."""
        guidance = self._input_guidance(x_RK)
        q = quant_rows(x_RK, guidance, self.row_group)
        _observe(self, x_RK, q, guidance)  # the codes themselves: no second quantization for observers
        return q

    def guidance_rows(self, x_RK: torch.Tensor, mb: context.MicroBatchGuidance | None = None) -> RowGuidance | None:
        """The guidance of `mb` (default: the active micro-batch's) for this rank's rows and
        columns of x_RK, or None if it has none. Expert sites read the rows the MoE layer
        dispatched for `mb` (`mb.expert_rows`)."""
        mb = context.active() if mb is None else mb
        if mb is None:
            return None
        if self.expert is not None or self.all_experts:
            rg = self._expert_rows(mb)
        else:
            rg = mb.site(self.layer, self.name)
            if rg is not None:
                rg = self._local_rows(rg, mb.num_tokens)
        if rg is None:
            return None
        if rg.num_rows != x_RK.shape[0] or rg.num_cols != x_RK.shape[1]:
            raise GuidanceFormatError(
                f"layer {self.layer} site {self.name}: guidance for {rg.num_rows} rows x {rg.num_cols} columns, "
                f"but this rank quantizes {x_RK.shape[0]} x {x_RK.shape[1]}")
        return rg

    def for_expert(self, expert: int) -> FP4Site:
        """The site of local expert `expert` alone, from a site of all local experts (a grouped
        GEMM that quantizes each expert's rows on their own, as TE's GroupedLinear does)."""
        if not self.all_experts:
            raise ValueError(f"layer {self.layer} site {self.name}: for_expert needs a site of all local experts")
        return replace(self, all_experts=False, expert=expert)

    def expert_guidance_rows(self, mb: context.MicroBatchGuidance | None = None) -> int | None:
        """How many rows the guidance of `mb` (default: the active micro-batch's) has for this
        expert site; None when it has none (not an expert site, or no guidance for the layer)."""
        mb = context.active() if mb is None else mb
        if self.expert is None or mb is None or self.layer not in mb.expert_rows:
            return None
        return mb.expert_counts(self.layer)[self.expert]

    def _local_rows(self, rg: RowGuidance, num_tokens: int) -> RowGuidance:
        if self.tokens is not None and self.tokens.size > 1:
            rg = rg.select_rows(slice(*self.tokens.span(num_tokens)))
        if self.heads is not None and self.heads.size > 1:
            n_heads = rg.num_rows // num_tokens
            lo, hi = self.heads.span(n_heads)
            idx = (torch.arange(num_tokens)[:, None] * n_heads + torch.arange(lo, hi)[None, :]).reshape(-1)
            rg = rg.select_rows(idx.to(rg.g.device))
        if self.cols is not None and self.cols.size > 1:
            rg = rg.select_cols(*self.cols.span(rg.num_cols))
        return rg

    def _expert_rows(self, mb: context.MicroBatchGuidance) -> RowGuidance | None:
        entry = mb.expert_rows.get(self.layer)
        if entry is None:
            return None
        rg = entry[0]
        if not self.all_experts:
            counts = mb.expert_counts(self.layer)
            start = sum(counts[: self.expert])
            rg = rg.select_rows(slice(start, start + counts[self.expert]))
        if self.cols is not None and self.cols.size > 1:
            rg = rg.select_cols(*self.cols.span(rg.num_cols))
        return rg
