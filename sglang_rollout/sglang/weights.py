"""Weight updates inside SGLang's scheduler processes (SGLang's `custom_weight_loader` hook): the
trainer's weight buckets (`weight_payload`), FP4 sites packed or BF16, placed into this
tensor-parallel rank's packed FP4 storage in place (CUDA graphs keep reading the same buffers),
the rest through the model's own loaders.

Buckets hold weights under Megatron's full names (megatron/weights.py), whole or in slices. A
BF16 engine (no trace_fp4) loads everything through the model's loaders. The sender checks
every bucket before it goes (`weight_payload.checked`): an exception in a scheduler process
stops SGLang, so none may be raised here for bad input.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_trace.checkpoint.hf_layout import hf_parts, to_hf
from megatron_trace.model_config import ModelConfig, fp4_site_of, fp4_weight_peers
from megatron_trace.weight_buckets import NVFP4, new_value, read_bucket, write_piece
from trace_kernels.fp4 import Format, QTensor, quantize

from .quant import ExpertWeights, store_linear
from .weight_payload import MODEL_ENV, parse_bucket_name

_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc(\d)\.weight")


def load_trace_weights(model, named_tensors) -> None:
    """SGLang's custom weight loader: write TRACE's weight buckets (`weight_payload`: each a flat
    uint8 tensor named `trace-bucket/v<version>/<index>`, checked by the sender) into `model`
    (SGLang's Qwen3MoeForCausalLM on this TP rank). A weight that arrives in slices is put
    together in host memory (a trainer's TP shards arrive from each rank in turn: on the GPU
    they could add up to a second model) and written once its last slice is in."""
    model_cfg = model_config_of(model)
    fp4 = any(hasattr(m, "trace_weight") for m in model.model.layers[0].modules())
    for name, flat in named_tensors:
        version, index = parse_bucket_name(name)
        staged = getattr(model, "_trace_staged", None)
        if index == 0 or staged is None or staged[0] != version:  # a new update: slices of an old one are void
            staged = model._trace_staged = (version, {}, {})
        whole = {}
        for piece, parts in read_bucket(flat):
            if piece.shape == piece.full_shape:
                whole[piece.name] = _value(piece, parts)
                continue
            held, arrived = staged[1].get(piece.name, (None, 0))
            if held is None:
                held = new_value(piece, "cpu")
            write_piece(held, piece, parts)
            arrived += piece.length
            if arrived == piece.full_shape[piece.dim]:
                staged[1].pop(piece.name, None)
                whole[piece.name] = held
            else:
                staged[1][piece.name] = (held, arrived)
        _write(model, model_cfg, _with_peers(whole, staged[2], model_cfg, fp4), fp4)


def _with_peers(whole: dict, held: dict, model_cfg: ModelConfig, fp4: bool) -> dict:
    """`whole` with weights that share a global scale (`fp4_weight_peers`: MLA's q and KV down
    projections, one fused linear in SGLang) held in `held` until all their peers are in, then
    together: quantized with their joint amax when they came in BF16 to an FP4 engine (SGLang's own
    loader, too, fuses them only when both come in one call)."""
    out = {}
    for name, t in whole.items():
        peers = fp4_weight_peers(name, model_cfg)
        if not peers:
            out[name] = t
            continue
        held[name] = t
        if all(p in held for p in peers):
            group = {p: held.pop(p) for p in peers}
            if fp4 and not any(isinstance(v, QTensor) for v in group.values()):
                amax = torch.stack([v.abs().amax().float() for v in group.values()]).amax()
                group = {p: quantize(v, "nvfp4", global_amax=amax, check_finite=False) for p, v in group.items()}
            out |= group
    return out


def _value(piece, parts) -> torch.Tensor | QTensor:
    """A whole piece's value: the tensor, or the packed QTensor its parts make."""
    if piece.kind != NVFP4:
        return parts[0]
    return QTensor(parts[0], parts[1].view(torch.float8_e4m3fn), parts[2].reshape(()), Format.NVFP4,
                   torch.Size(piece.full_shape))


def _write(model, model_cfg: ModelConfig, state_dict: dict, fp4: bool) -> None:
    """Write whole weights (Megatron names; packed QTensors or plain) into `model`."""
    writes = [_plan(model, model_cfg, name, t, fp4) for name, t in state_dict.items()]
    hf = [pair for w in writes if w[0] == "hf" for pair in w[1]]
    for kind, *args in writes:
        if kind == "fn":
            write, *rest = args
            write(*rest)
    if hf:
        model.load_weights(hf)


def model_config_of(model) -> ModelConfig:
    """TRACE's ModelConfig of the engine, as its host process wrote it into the environment
    (SGLang's own view of the HF config is adjusted to its tensor parallelism)."""
    spec = os.environ.get(MODEL_ENV)
    if not spec:
        raise RuntimeError(f"{MODEL_ENV} is not set: trace's weight loader serves engines that SGLangEngine started")
    return ModelConfig(**json.loads(spec))


def _plan(model, model_cfg: ModelConfig, name: str, t, fp4: bool) -> tuple:
    """What writing tensor `name` takes: ("hf", HF pairs for model.load_weights), ("fn", write,
    args...) for a packed FP4 site of this rank, or ("skip",) for another rank's expert."""
    site = fp4_site_of(name) if fp4 else None
    if site is None:
        return ("hf", to_hf(name, t, model_cfg))
    q = t if isinstance(t, QTensor) else quantize(t, "nvfp4", check_finite=False)
    layer, kind = site
    block = model.model.layers[layer]
    if model_cfg.mla and not _EXPERT.fullmatch(name):
        return ("fn", _write_rows, [_mla_family_target(block, model_cfg, name, q, hf, idx)
                                    for hf, idx in hf_parts(name, model_cfg)])
    if kind in ("qkv", "proj"):
        linear = block.self_attn.qkv_proj if kind == "qkv" else block.self_attn.o_proj
        return ("fn", store_linear, linear, _linear_shard(linear, model_cfg, name, q, kind))
    m = _EXPERT.fullmatch(name)
    experts, expert = block.mlp.experts, int(m[2])
    local = _local_expert(experts, expert)
    if local is None:
        return ("skip",)
    which = "w13" if kind == "fc1" else "w2"
    return ("fn", _store_expert, getattr(experts, f"trace_{which}"), local, _expert_shard(experts, q, which, name))


def _linear_shard(linear, model_cfg: ModelConfig, name: str, q: QTensor, kind: str) -> QTensor:
    """This rank's rows (QKV: its query and KV heads, in SGLang's [q | k | v] order) or columns
    (the output projection) of a packed weight, global scale unchanged."""
    rank, size = getattr(linear, "tp_rank", 0), getattr(linear, "tp_size", 1)
    codes, scales = q.codes, q.block_scales
    if kind == "qkv":
        parts = to_hf(name, torch.arange(codes.shape[0]), model_cfg)  # row indices of q, k, v
        d = model_cfg.head_dim
        rows = []
        for _, idx in parts:
            heads = idx.numel() // d
            per = max(1, heads // size)  # KV heads are replicated when fewer than ranks
            first = rank * per if heads >= size else rank * heads // size
            rows.append(idx.view(heads, d)[first:first + per].reshape(-1))
        rows = torch.cat(rows)
        codes, scales = codes[rows], scales[rows]
    elif size > 1:
        k = q.shape[-1] // size
        codes, scales = codes[:, rank * k // 2:(rank + 1) * k // 2], scales[:, rank * k // 16:(rank + 1) * k // 16]
    n, k2 = codes.shape
    want = tuple(linear.trace_weight.codes.shape)
    if (n, k2) != want:
        raise ValueError(f"weight update: {name} gives this rank codes {(n, k2)}, its layer holds {want}")
    return QTensor(codes.contiguous(), scales.contiguous(), q.global_scale, Format.NVFP4, torch.Size((n, 2 * k2)))


def _mla_family_target(block, model_cfg: ModelConfig, name: str, q: QTensor, hf: str, idx) -> tuple:
    """(SGLang linear, first row, this rank's codes, scales, global scale) of HF part `hf` (rows
    `idx` of Megatron weight `name`, None: all) of a DeepSeek-V3-family FP4 weight: replicated
    linears take all rows (the q and KV down projections fused: kv_a after q_a's rows), column-
    parallel ones this rank's contiguous share (gate_up: the gate share, then the up share),
    row-parallel ones this rank's columns."""
    from sglang.srt.layers.linear import ReplicatedLinear, RowParallelLinear

    attn, leaf = block.self_attn, hf.split(".")[-2]
    owner = block.mlp.shared_experts if ".shared_experts." in hf else block.mlp
    codes, scales = q.codes, q.block_scales.view(torch.uint8)
    if idx is not None:
        codes, scales = codes[idx], scales[idx]
    first = 0
    if leaf == "q_a_proj":
        linear = attn.fused_qkv_a_proj_with_mqa
    elif leaf == "kv_a_proj_with_mqa" and model_cfg.q_lora_rank:
        linear, first = attn.fused_qkv_a_proj_with_mqa, model_cfg.q_lora_rank
    elif leaf in ("gate_proj", "up_proj", "down_proj"):
        linear = owner.down_proj if leaf == "down_proj" else owner.gate_up_proj
    else:  # q_proj, kv_a_proj_with_mqa (no q latent), q_b_proj, kv_b_proj, o_proj
        linear = getattr(attn, leaf)
    rank, size = getattr(linear, "tp_rank", 0), getattr(linear, "tp_size", 1)
    if isinstance(linear, RowParallelLinear):
        k = q.shape[-1] // size
        codes, scales = codes[:, rank * k // 2:(rank + 1) * k // 2], scales[:, rank * k // 16:(rank + 1) * k // 16]
    elif not isinstance(linear, ReplicatedLinear):
        per = codes.shape[0] // size
        codes, scales = codes[rank * per:(rank + 1) * per], scales[rank * per:(rank + 1) * per]
        first = per if leaf == "up_proj" else 0
    held = linear.trace_weight
    if first + codes.shape[0] > held.codes.shape[0] or codes.shape[1] != held.codes.shape[1]:
        raise ValueError(f"weight update: {name} ({hf}) gives this rank codes {tuple(codes.shape)} at row {first}, "
                         f"its layer holds {tuple(held.codes.shape)}")
    return linear, first, codes, scales, q.global_scale.reshape(())


def _write_rows(targets: list) -> None:
    """Write each target's rows into its linear's packed weight in place (`_mla_family_target`)."""
    for linear, first, codes, scales, g in targets:
        held = linear.trace_weight
        rows = slice(first, first + codes.shape[0])
        held.codes[rows] = codes.to(held.codes.device)
        held.block_scales.view(torch.uint8)[rows] = scales.to(held.codes.device)
        held.global_scale.copy_(g)


def _local_expert(experts, expert: int) -> int | None:
    """The local index of global expert `expert` on this rank (None: another rank's)."""
    ep_rank, ep_size = getattr(experts, "moe_ep_rank", 0), getattr(experts, "moe_ep_size", 1)
    per = experts.num_experts // ep_size
    return expert - ep_rank * per if ep_rank * per <= expert < (ep_rank + 1) * per else None


def _expert_shard(experts, q: QTensor, which: str, name: str) -> tuple:
    """(codes, scales, g) of this rank's part of one expert's packed weight: under moe-TP, its
    slice of the gate and up rows (w13) or of the down projection's columns (w2)."""
    rank, size = getattr(experts, "moe_tp_rank", 0), getattr(experts, "moe_tp_size", 1)
    codes, scales = q.codes, q.block_scales.view(torch.uint8)
    if size > 1 and which == "w13":
        f = codes.shape[0] // 2
        part = f // size
        mine = torch.arange(rank * part, (rank + 1) * part)
        rows = torch.cat([mine, f + mine])  # this rank's gate rows, then its up rows
        codes, scales = codes[rows], scales[rows]
    elif size > 1:
        k = q.shape[-1] // size
        codes, scales = codes[:, rank * k // 2:(rank + 1) * k // 2], scales[:, rank * k // 16:(rank + 1) * k // 16]
    held = getattr(experts, f"trace_{which}")
    if tuple(codes.shape) != tuple(held.codes.shape[1:]):
        raise ValueError(f"weight update: {name} gives this rank codes {tuple(codes.shape)}, its experts hold "
                         f"{tuple(held.codes.shape[1:])} (moe-TP {size}, EP {getattr(experts, 'moe_ep_size', 1)}, "
                         f"{experts.intermediate_size_per_partition} intermediate per rank)")
    return codes, scales.view(torch.float8_e4m3fn), q.global_scale.reshape(())


def _store_expert(held: ExpertWeights, local: int, parts: tuple) -> None:
    codes, scales, g = parts
    held.codes[local].copy_(codes)
    held.scales[local].copy_(scales)
    held.g[local].copy_(g)
