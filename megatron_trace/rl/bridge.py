"""Messages between the trainer ranks and the engine ranks of one torchrun job.

Under torchrun, ranks [0, T) train (their own torch.distributed world, which Megatron's parallel
state lives in) and ranks [T, T + E) run engines. `Bridge` is a process group of its own over
all T + E ranks (gloo: the control messages and, for now, the weights and guidance too), built
from torchrun's rendezvous store under a prefix, so it never enters the trainers' world.
Objects travel in torch.save's format: a size, then the bytes.
"""

from __future__ import annotations

import datetime
import io
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Roles:
    """This process's place in a disaggregated job: `rank` of `world` = trainers + engines."""

    rank: int
    world: int
    trainers: int

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainers

    @property
    def engines(self) -> list[int]:
        return list(range(self.trainers, self.world))

    @classmethod
    def from_env(cls, engine_ranks: int) -> Roles:
        """From torchrun's RANK / WORLD_SIZE. ValueError when the job cannot hold the engines."""
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if engine_ranks < 1 or world - engine_ranks < 1:
            raise ValueError(f"dist.engine_ranks={engine_ranks} needs a torchrun job of more than {engine_ranks} "
                             f"processes (WORLD_SIZE={world}); the rest train")
        return cls(rank, world, world - engine_ranks)


def rendezvous_store(timeout_s: float = 1800) -> dist.Store:
    """A client of torchrun's store (MASTER_ADDR / MASTER_PORT), or the host of one on rank 0 when
    torchrun's agent does not host it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=not agent and int(os.environ["RANK"]) == 0,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Bridge:
    """Point-to-point objects (torch.save format) over a gloo group spanning trainer and engine ranks."""

    def __init__(self, store: dist.Store, roles: Roles, timeout_s: float = 1800):
        self.roles = roles
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("trace-bridge", store), roles.rank, roles.world, opts)
        self._tag = 0

    def send(self, obj, dst: int) -> int:
        """Send `obj` to rank `dst`; returns the bytes sent."""
        buf = io.BytesIO()
        torch.save(obj, buf)  # torch's format: any tensor dtype (FP8 scales, packed codes), views included
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()
        return data.numel()

    def recv(self, src: int):
        """The next object `src` sent."""
        size = torch.empty(1, dtype=torch.int64)
        self.pg.recv([size], src, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.recv([data], src, 1).wait()
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)  # from our own trainer ranks
