"""The process group a disaggregated trainer sends weights over to SGLang's scheduler processes.

SGLang's `init_weights_update_group` makes each tensor-parallel rank r of the engine rank
`1 + r` of a group of its own, rendezvousing over TCP at the trainer's address; the trainer
(rank 0) must make the same rendezvous. This module is that side: the same TCP rendezvous, the
same store prefix (the group's name), the same group helper torch's `new_group` uses, so the
trainer process keeps its own default group untouched. NCCL between GPUs, gloo between CPUs.
"""

from __future__ import annotations

import contextlib
import random
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def free_port() -> int:
    """A TCP port that was free a moment ago on this host, below the kernel's ephemeral range
    (ip_local_port_range) where it can: a port from bind(("", 0)) comes from that range, and on a
    host busy with gloo connections an outgoing one was given it before its listener bound it
    (SGLang's scheduler failed to start with EADDRINUSE in a CI run)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's choice
        low = 0
    pick = random.SystemRandom()
    for _ in range(64 if low > 21000 else 0):
        port = pick.randrange(20000, low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("", port))
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_group(master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
               backend: str, timeout_s: float = 300) -> dist.ProcessGroup:
    """Join the weight-update group `group_name` as `rank` of `world_size` (blocks until every
    rank has joined, at most timeout_s). backend: "nccl" or "gloo"."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store), group_name=group_name,
                                              backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_group(group: dist.ProcessGroup) -> None:
    """Leave a group `open_group` made."""
    dist.destroy_process_group(group)


def broadcast_bucket(flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Send (rank 0) or receive (the others) one flat uint8 bucket over `group`."""
    dist.broadcast(flat, group_src=0, group=group)
