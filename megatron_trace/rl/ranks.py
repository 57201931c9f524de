"""The trainer ranks: whether there are several, which reports, and small reductions over them."""

from __future__ import annotations

import torch


def distributed_trainer() -> bool:
    """True under torchrun with several trainer ranks (their world is torch.distributed's)."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def is_rank0() -> bool:
    """True on the trainer rank that reports (prints, writes metrics): rank 0, or the only one."""
    return not distributed_trainer() or torch.distributed.get_rank() == 0


def reduce_over_ranks(n: int, op) -> int:
    """`n` reduced with `op` (a torch.distributed.ReduceOp) over the trainer ranks (a collective
    when there are several)."""
    if not distributed_trainer():
        return n
    t = torch.tensor([n], device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(t, op=op)
    return int(t.item())


def max_over_ranks(n: int) -> int:
    """The largest `n` of the trainer ranks."""
    return reduce_over_ranks(n, torch.distributed.ReduceOp.MAX)


def all_ranks(flag: bool) -> bool:
    """`flag` on every trainer rank."""
    return bool(reduce_over_ranks(int(flag), torch.distributed.ReduceOp.MIN))


def data_parallel() -> tuple[int, int, object]:
    """(rank, size, process group) of this rank's data-parallel group: Megatron's when its
    parallel state is up (the Megatron trainer), else every trainer rank (DeepSpeed's ZeRO)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()
    if not torch.distributed.is_initialized():
        return 0, 1, None
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), torch.distributed.group.WORLD
