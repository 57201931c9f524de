"""Full (unsharded) state dicts and this rank's shard of them.

The full form is what a one-process model's `state_dict()` holds: global layer numbers and
global expert numbers in the keys, whole tensors. `load_full_state_dict` copies this rank's
slice of each tensor into a model built under any TP/EP/PP layout; `held_slices` says which
slices of the full tensors a rank holds and sends in a weight sync:

| parameter | split over | dim |
|---|---|---|
| embedding.word_embeddings, output_layer | TP | 0 (vocabulary) |
| self_attention.linear_qkv weight and bias (query groups interleaved) | TP | 0 (whole query groups) |
| MLA's linear_q_down_proj, linear_kv_down_proj (column-parallel, gathered after) | TP | 0 |
| MLA's linear_q_proj, linear_q_up_proj, linear_kv_up_proj | TP | 0 (whole heads) |
| self_attention.linear_proj | TP | 1 |
| dense and shared experts' linear_fc1 ([gate; up]) | TP | 0, gate and up split separately |
| dense and shared experts' linear_fc2 | TP | 1 |
| experts' linear_fc1 ([gate; up]) | expert TP | 0, gate and up split separately |
| experts' linear_fc2 | expert TP | 1 |
| experts | EP | whole experts |
| layers | PP | whole layers |
| norms, router and its expert bias | replicated | |
"""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


_TP_ROWS = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
            "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
            "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")


def _split_rule(name: str) -> tuple[str | None, int, bool]:
    """(group "tp"/"etp"/None, dim, gated) for a parameter name."""
    if name.endswith(_TP_ROWS):
        return "tp", 0, False
    if name.endswith("linear_proj.weight"):
        return "tp", 1, False
    group = "etp" if ".local_experts." in name else "tp"
    if name.endswith("linear_fc1.weight"):
        return group, 0, True
    if name.endswith("linear_fc2.weight"):
        return group, 1, False
    return None, 0, False


# TE's grouped experts (te/spec.py) hold expert i's weight as `experts.linear_fc1.weight{i}`
_TE_GROUPED = re.compile(r"\.experts\.linear_(fc[12])\.weight(\d+)$")


def canonical_name(local_name: str) -> str:
    """A parameter's name as the local spec spells it: TE's grouped-expert weights
    (`mlp.experts.linear_fc1.weight3`) become `mlp.experts.local_experts.3.linear_fc1.weight`;
    every other name is already so."""
    return _TE_GROUPED.sub(lambda m: f".experts.local_experts.{m.group(2)}.linear_{m.group(1)}.weight", local_name)


def global_name(local_name: str, model: torch.nn.Module) -> str:
    """The full-state-dict key of one of this rank's parameters (the local spec's spelling)."""
    offset = get_transformer_layer_offset(model.config)
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", canonical_name(local_name))
    if ".local_experts." in name:
        n_local = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        first = ps.get_expert_model_parallel_rank() * n_local
        name = _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + first}.", name)
    return name


def shard_of(full: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's slice of the full tensor `full` of parameter `name` (local or global name)."""
    group, dim, gated = _split_rule(name)
    if group is None:
        return full
    size = ps.get_tensor_model_parallel_world_size() if group == "tp" else ps.get_expert_tensor_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank() if group == "tp" else ps.get_expert_tensor_parallel_rank()
    if gated:
        return torch.cat([part.chunk(size, dim)[rank] for part in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of `full` into `model`'s parameters.

    Raises:
        KeyError: a parameter of the model has no entry in `full`.
        ValueError: an entry's slice does not have the parameter's shape.
    """
    for local, param in model.state_dict(keep_vars=True).items():
        if local.endswith("_extra_state"):
            continue
        name = global_name(local, model)
        if name not in full:
            raise KeyError(f"full state dict has no {name!r} (for this rank's {local!r})")
        part = shard_of(full[name], name)
        if part.shape != param.shape:
            raise ValueError(f"{name}: slice {tuple(part.shape)} of full {tuple(full[name].shape)} does not fit "
                             f"this rank's {local} {tuple(param.shape)}")
        param.copy_(part)


def held_slices(name: str, local: torch.Tensor) -> list[tuple[int, int, tuple[int, ...], torch.Tensor]]:
    """(dim, start, full shape, values) of each slice of the full tensor of parameter `name`
    (global name) that this rank's `local` holds and sends in a weight sync: full[start : start +
    len] along dim (gate and up of a gated fc1 are two slices); [] when another rank sends it.
    A tensor is sent by its first data-parallel replica (expert-data-parallel for experts), each
    tensor-parallel (expert-TP) rank its slice, a replicated tensor by tensor-parallel rank 0."""
    group, dim, gated = _split_rule(name)
    expert = ".local_experts." in name
    dp_rank = ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()
    if group is None:
        tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
        return [(0, 0, tuple(local.shape), local)] if dp_rank == 0 and tp_rank == 0 else []
    if dp_rank != 0:
        return []
    size = ps.get_tensor_model_parallel_world_size() if group == "tp" else ps.get_expert_tensor_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank() if group == "tp" else ps.get_expert_tensor_parallel_rank()
    if size == 1:
        return [(0, 0, tuple(local.shape), local)]
    full = list(local.shape)
    full[dim] *= size
    if not gated:
        n = local.shape[dim]
        return [(dim, rank * n, tuple(full), local)]
    half = local.shape[dim] // 2  # this rank's [gate_r; up_r]; the full tensor is [gate; up]
    return [(dim, rank * half, tuple(full), local.narrow(dim, 0, half)),
            (dim, full[dim] // 2 + rank * half, tuple(full), local.narrow(dim, half, half))]
