"""The whole model on one rank, for tests: the reference a sharded weight sync is compared with
(the trainer itself never gathers it; `megatron_trace.rl.weight_sync` sends shards)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from megatron_trace.megatron.weights import _split_rule, global_name


def _gather_shards(local: torch.Tensor, name: str) -> torch.Tensor:
    """The full tensor of parameter `name` from this rank's slice (collective over its TP or
    expert-TP group; the inverse of `shard_of`)."""
    group, dim, gated = _split_rule(name)
    if group is None:
        return local
    pg = ps.get_tensor_model_parallel_group() if group == "tp" else ps.get_expert_tensor_parallel_group()
    size = torch.distributed.get_world_size(pg)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=pg)
    if gated:  # each rank holds [gate_r; up_r]
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(parts, dim)


@torch.no_grad()
def gather_full_state_dict(model: torch.nn.Module, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The full state dict (CPU tensors) on global rank `dst` of the trainers' world, None elsewhere;
    call on every rank. The inverse of `load_full_state_dict`: tensor-parallel slices are
    gathered, and each tensor is contributed once (by the first TP / expert-TP and data-parallel
    replica of its stage and experts)."""
    mine = {}
    for local, param in model.state_dict(keep_vars=True).items():
        if local.endswith("_extra_state"):
            continue
        name = global_name(local, model)
        full = _gather_shards(param.detach(), name)
        expert = ".local_experts." in name
        first = (ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0) if expert \
            else (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0)
        if first:
            mine[name] = full.cpu()
    world = torch.distributed.get_world_size()
    gathered = [None] * world if torch.distributed.get_rank() == dst else None
    torch.distributed.gather_object(mine, gathered, dst=dst)
    if gathered is None:
        return None
    return {k: v for part in gathered for k, v in part.items()}
