"""Messages between the trainer ranks and the engine ranks of one torchrun job.

Under torchrun, ranks [0, T) train (their own torch.distributed world, which Megatron's parallel
state lives in) and ranks [T, T + E) run engines. `Bridge` is a process group of its own over
all T + E ranks (NCCL when every rank has a GPU of its own, else gloo), carrying the requests,
the weights and the guidance; it is built from torchrun's rendezvous store under a prefix, so it
never enters the trainers' world.
Objects travel in torch.save's format: a size, then the bytes; flat buffers (weight buckets) as
they are, a size, then the buffer.
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


BACKENDS = ("auto", "gloo", "nccl")


class Bridge:
    """Point-to-point objects (torch.save format) over a process group spanning trainer and
    engine ranks: gloo, or NCCL (bytes staged in GPU memory) when every rank has a GPU of its
    own. "auto" takes NCCL when it can."""

    def __init__(self, store: dist.Store, roles: Roles, backend: str = "auto", timeout_s: float = 1800):
        if backend not in BACKENDS:
            raise ValueError(f"dist.bridge must be one of {BACKENDS}, got {backend!r}")
        own_gpu = torch.cuda.is_available() and roles.world <= torch.cuda.device_count() * _nodes()
        if backend == "nccl" and not own_gpu:
            raise ValueError("dist.bridge=nccl needs a GPU of its own for every rank (NCCL cannot put two ranks "
                             "of one group on one device)")
        self.roles, self.backend = roles, "nccl" if backend == "nccl" or (backend == "auto" and own_gpu) else "gloo"
        prefix = dist.PrefixStore("trace-bridge", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg, self.device = dist.ProcessGroupNCCL(prefix, roles.rank, roles.world, opts), torch.device("cuda")
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
            self.pg, self.device = dist.ProcessGroupGloo(prefix, roles.rank, roles.world, opts), torch.device("cpu")

    def send(self, obj, dst: int) -> int:
        """Send `obj` to rank `dst`; returns the bytes sent."""
        buf = io.BytesIO()
        torch.save(obj, buf)  # torch's format: any tensor dtype (FP8 scales, packed codes), views included
        return self.send_buffer(torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8), dst)

    def recv(self, src: int):
        """The next object `src` sent."""
        data = self.recv_buffer(src)
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)  # from our own ranks

    def send_buffer(self, data: torch.Tensor, dst: int) -> int:
        """Send a flat uint8 tensor to rank `dst` as it is (no serialisation; copied only if it is
        not on the bridge's device); returns the bytes sent."""
        data = data.to(self.device)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64, device=self.device)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()
        return data.numel()

    def recv_buffer(self, src: int) -> torch.Tensor:
        """The next flat uint8 tensor `src` sent (send or send_buffer), on the bridge's device."""
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.pg.recv([size], src, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.pg.recv([data], src, 1).wait()
        return data


def _nodes() -> int:
    """Machines in the job: GROUP_WORLD_SIZE (torchrun's, or SLURM's nodes), else the world over
    the per-node process count (nodes may run different counts: engine ranks hold several GPUs)."""
    if os.environ.get("GROUP_WORLD_SIZE"):
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, int(os.environ.get("WORLD_SIZE", 1)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
