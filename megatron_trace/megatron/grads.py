"""Gradient reduction across the trainer's parallel groups after backward, as Megatron's
DistributedDataParallel and finalize_model_grads do (without their bucketing).

Each data-parallel rank's loss is a mean over its own tokens; the objective is the mean of
those losses, so every gradient is scaled by 1 / data-parallel size, dense gradients are summed
over the data-parallel group and expert gradients over the expert-data-parallel group (the
token dispatch already summed the expert-parallel ranks' contributions). Sequence-parallel
parameters (norms) are summed over the tensor-parallel group first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


@torch.no_grad()
def finalize_grads(model: torch.nn.Module) -> None:
    """Reduce `model`'s .grad in place (call on every trainer rank, after backward)."""
    tp_group = ps.get_tensor_model_parallel_group()
    dp_size = ps.get_data_parallel_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "sequence_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(p.grad, group=tp_group)
        if dp_size == 1:
            continue
        p.grad.div_(dp_size)
        expert = not getattr(p, "allreduce", True)  # Megatron marks expert parameters so
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
