"""The HF model's weights under the Megatron trainer's full names, a layer at a time: what the
DeepSpeed trainer sends to the engines (which load Megatron-named state dicts) and what TRACE's
checkpoint tools read.

Under ZeRO-3 each rank holds a partition of every parameter; a layer's parameters are gathered
together (`deepspeed.zero.GatheredParameters`), converted, copied out and released before the
next layer's, so no rank ever holds more than one layer's whole weights beyond what it yields
(OpenRLHF gathers one parameter at a time; a layer is the unit here because Megatron's fused QKV
weight needs q, k and v together). Without ZeRO-3 nothing is gathered.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from itertools import groupby

import torch
import torch.distributed as dist

from ..checkpoint.hf_layout import full_weight_shapes, hf_parts, to_megatron
from ..model_config import FP4_WEIGHT_SUFFIXES, ModelConfig
from ..weight_buckets import NVFP4, Buckets, Piece, Source, amax_of

_FUSED_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def checkpoint_tensor(name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' checkpoint tensor `name` (experts one by one: experts.{e}.gate_proj.weight
    [I, H], up_proj [I, H], down_proj [H, I]) from the model's parameters `params` (in memory the
    experts are fused: gate_up_proj [E, 2I, H] with gate first, down_proj [E, H, I]). A view."""
    m = _FUSED_EXPERT.match(name)
    if m is None:
        return params[name]
    prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
    if which == "down":
        return params[f"{prefix}.down_proj"][expert]
    gate_up = params[f"{prefix}.gate_up_proj"][expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if which == "gate" else gate_up[half:]


def _gathered(params: list[torch.nn.Parameter]):
    """The whole values of ZeRO-3-partitioned `params` for the duration of the context."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def megatron_weights(model: torch.nn.Module, model_cfg: ModelConfig,
                     device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(full Megatron name, tensor) of every weight of a transformers Qwen3-MoE model (patched by
    attach_fp4_sites or not; under ZeRO-3 or not), in the order of `full_weight_shapes`, a layer
    gathered at a time, each tensor a copy on `device` in the parameter's dtype. Call on every
    rank under ZeRO-3 (the gathers are collective)."""
    params = dict(model.named_parameters())
    if model_cfg.tie_word_embeddings:
        params.setdefault("lm_head.weight", params["model.embed_tokens.weight"])

    for _, names in groupby(full_weight_shapes(model_cfg), key=_layer_of):
        names = list(names)
        parts = {name: [h for h, _ in hf_parts(name, model_cfg)] for name in names}
        needed = {_FUSED_EXPERT.sub(lambda m: f"{m.group(1)}.{'down' if m.group(3) == 'down' else 'gate_up'}_proj",
                                    h) for hs in parts.values() for h in hs}
        missing = sorted(needed - set(params))
        if missing:
            raise ValueError(f"the model has no parameters {missing[:4]} for the Megatron weights {names[:2]}")
        with _gathered([params[n] for n in sorted(needed)]), torch.no_grad():
            out = [(name, to_megatron(name, [checkpoint_tensor(h, params) for h in hs], model_cfg)
                    .to(device, copy=True)) for name, hs in parts.items()]
        yield from out


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return -1 if m is None else int(m.group(1))


class LayerBuckets:
    """The model's weights as the engines take them (a sized iterable of flat uint8 buckets, as
    megatron_trace.weight_buckets.Buckets), made a layer at a time: megatron_weights gathers and
    copies out one layer, its buckets of at most max_bytes are cut and handed over, then the next
    (a bucket never spans two layers). Matrices BF16, norms FP32 (the Megatron trainer's dtypes);
    with `fp4` the FP4 sites' weights packed with the whole tensor's amax, as the trainer's forward
    quantizes them. The number of buckets follows from the shapes, before any gather. Iterating is
    collective under ZeRO-3 (the gathers): every rank iterates, or takes part in the gathers."""

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, fp4: bool, max_bytes: int,
                 sender: bool = True):
        self.model, self.model_cfg, self.fp4, self.max_bytes = model, model_cfg, fp4, max_bytes
        self.sender = sender  # False: no buckets; iterating only takes part in ZeRO-3's gathers, in step
        layers = groupby(full_weight_shapes(model_cfg).items(), key=lambda item: _layer_of(item[0]))
        self.counts = [len(Buckets([Source(self._piece(name, shape), None) for name, shape in items], max_bytes, "cpu"))
                       if sender else 0 for _, items in layers]
        self.nbytes = 0

    def _piece(self, name: str, shape: tuple[int, ...]) -> Piece:
        kind = NVFP4 if self.fp4 and name.endswith(FP4_WEIGHT_SUFFIXES) else "bfloat16" if len(shape) > 1 else "float32"
        return Piece(name, kind, 0, 0, tuple(shape), tuple(shape))

    def __len__(self) -> int:
        return sum(self.counts)

    def __iter__(self):
        if not self.sender:
            if any(hasattr(p, "ds_id") for p in self.model.parameters()):  # ZeRO-3: the sender's gathers
                for _ in megatron_weights(self.model, self.model_cfg, device="meta"):
                    pass
            return
        layers = groupby(megatron_weights(self.model, self.model_cfg), key=lambda item: _layer_of(item[0]))
        for count, (_, items) in zip(self.counts, layers, strict=True):
            sources = []
            for name, t in items:
                t = t.to(torch.bfloat16 if t.dim() > 1 else torch.float32)
                piece = self._piece(name, tuple(t.shape))
                sources.append(Source(piece, t, amax_of(t) if piece.kind == NVFP4 else None))
            buckets = Buckets(sources, self.max_bytes)
            if len(buckets) != count:
                raise RuntimeError(f"weight sync: a layer made {len(buckets)} buckets, its shapes {count}")
            for flat in buckets:
                self.nbytes += flat.numel()
                yield flat


def save_hf(model: torch.nn.Module, model_cfg: ModelConfig, out, max_shard_bytes: int = 2 << 30) -> None:
    """The model's weights as an HF checkpoint at `out` (sharded safetensors, index, config.json;
    BF16), written by rank 0 as they are gathered, a layer at a time; the directory appears
    complete or not at all. Collective under ZeRO-3 (the gathers): call on every rank."""
    from ..checkpoint.hf_layout import hf_config, to_hf
    from ..checkpoint.safetensors_io import ShardedWriter

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    writer = ShardedWriter(out, max_shard_bytes) if rank0 else None
    try:
        for name, tensor in megatron_weights(model, model_cfg):
            if writer is None or (name == "output_layer.weight" and model_cfg.tie_word_embeddings):
                continue
            for hf_name, part in to_hf(name, tensor.to(torch.bfloat16), model_cfg):
                writer.add(hf_name, part)
        if writer is not None:
            writer.close({"config.json": hf_config(model_cfg)})
    finally:
        if writer is not None and not writer.closed:  # an exception: leave nothing behind
            writer.abort()
    if dist.is_initialized():
        dist.barrier()  # the checkpoint is in place before any rank goes on
