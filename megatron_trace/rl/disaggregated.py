"""`trace-rl train` under torchrun: trainer ranks run Megatron, engine ranks run rollout engines.

The RL loop is the colocated one (`rl.step`); the trainer ranks see the engines through
`RemoteEngine`, a RolloutBackend whose calls travel over the `Bridge`:
    generate:        trainer rank 0 splits the requests into contiguous shares, one per engine;
                     each engine streams every finished group (samples, log-probs, routed
                     experts, guidance records) to the trainer ranks whose data-parallel rank
                     trains on it (contiguous shares of the step's groups) while the other
                     groups still generate, then an end marker;
    update_weights:  the trainers gather the full weights on rank 0 (FP4 sites packed by the
                     shared quantizer when the engines run FP4), which sends them to every engine.
Engine ranks run `serve_engine` until the trainers say stop. Gradients are reduced across the
trainer's groups by `megatron.grads.finalize_grads` before each optimizer step.
Trainer layouts: any TP / EP / PP / DP (the step runs Megatron's pipeline schedule).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..guidance import GuidanceBatch
from ..modes import EnginePrecision
from ..rollout import GroupRequest, RolloutOutput, SamplingParams
from .bridge import Bridge


def dp_share(num_groups: int, dp_rank: int, dp_size: int) -> range:
    """The groups data-parallel rank `dp_rank` trains on: a contiguous share, the first
    `num_groups % dp_size` ranks taking one more."""
    base, extra = divmod(num_groups, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (dp_rank < extra))


class RemoteEngine:
    """The RolloutBackend the trainer ranks call (see module docstring)."""

    def __init__(self, bridge: Bridge, precision: EnginePrecision | str, guide: str, coding: str):
        from megatron.core import parallel_state as ps

        self.bridge, self.precision, self.weight_version = bridge, EnginePrecision(precision), -1
        if dist.get_rank() == 0:  # every engine (re)builds its engine for these settings
            for e in bridge.roles.engines:
                bridge.send(("configure", precision, guide, coding), e)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # which data-parallel rank every trainer rank belongs to, for the engine's sends
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, self.dp_rank)
        self.dp_of_rank = ranks

    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> RolloutOutput:
        """Every engine generates a contiguous share of the groups (samples are seeded by their
        ids, so the split does not change them); this rank gets its data-parallel rank's groups."""
        engines = self.bridge.roles.engines
        if dist.get_rank() == 0:
            for i, e in enumerate(engines):
                share = dp_share(len(requests), i, len(engines))
                self.bridge.send(("generate", requests[share.start:share.stop], sampling, share.start, len(requests),
                                  self.dp_size, self.dp_of_rank), e)
        parts = {}  # group id -> its output, streamed as the engines finish groups
        for e in engines:
            while (msg := self.bridge.recv(e)) != "end":
                parts[msg.samples[0].group_id] = msg
        ordered = [parts[r.group_id] for r in requests if r.group_id in parts]
        return RolloutOutput([s for p in ordered for s in p.samples],
                             GuidanceBatch({k: v for p in ordered for k, v in p.guidance.groups.items()},
                                           {k: v for p in ordered for k, v in p.guidance.samples.items()}))

    def update_weights(self, state_dict: dict | None, version: int) -> None:
        """`state_dict`: the full weights on trainer rank 0 (None on the others)."""
        if dist.get_rank() == 0:
            for e in self.bridge.roles.engines:
                self.bridge.send(("weights", state_dict, version), e)
            for e in self.bridge.roles.engines:
                reply = self.bridge.recv(e)
                if reply != ("ok", version):
                    raise RuntimeError(f"engine rank {e} refused weights version {version}: {reply}")
        dist.barrier()
        self.weight_version = version


def serve_engine(bridge: Bridge, make_engine) -> None:
    """Answer the trainers' requests until they send stop, with the engine that
    make_engine(precision, guide, coding) builds when they configure one (a RolloutBackend)."""
    engine = None
    while True:
        msg = bridge.recv(0)
        if msg[0] == "stop":
            return
        if msg[0] == "configure":
            engine = None  # free the old one first
            engine = make_engine(*msg[1:])
            continue
        if msg[0] == "weights":
            _, state_dict, version = msg
            try:
                engine.update_weights(state_dict, version)
                bridge.send(("ok", version), 0)
            except ValueError as e:
                bridge.send(("error", str(e)), 0)
            continue
        _, requests, sampling, first, total, dp_size, dp_of_rank = msg
        index = {r.group_id: first + i for i, r in enumerate(requests)}  # in the step's `total` groups

        def send_group(out: RolloutOutput) -> None:  # while the other groups still generate
            gid = out.samples[0].group_id
            for rank, dp in enumerate(dp_of_rank):
                if index[gid] in dp_share(total, dp, dp_size):
                    bridge.send(out, rank)
        engine.generate(requests, sampling, on_group=send_group)
        for rank in range(len(dp_of_rank)):
            bridge.send("end", rank)


class ReducingOptimizer:
    """An optimizer whose step first reduces the gradients across the trainer's groups."""

    def __init__(self, optimizer, model: torch.nn.Module):
        self.optimizer, self.model = optimizer, model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        from ..megatron.grads import finalize_grads

        finalize_grads(self.model)
        self.optimizer.step()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


SENT_BY_RANK0 = ("weight_sync_bytes",)  # the other ranks report 0: the job's figure is rank 0's


def average_metrics(m: dict) -> dict:
    """Every numeric metric (and per-layer dict) averaged over the trainer ranks."""
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
    flat = {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}
    keys = sorted(k for k in flat if k not in SENT_BY_RANK0)
    t = torch.tensor([flat[k] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    out = dict(m) | {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist(), strict=True)}
    for k in SENT_BY_RANK0:
        if k in flat:
            x = torch.tensor(flat[k], dtype=torch.float64, device=dev)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            out[k] = float(x)
    for k, v in m.items():
        if isinstance(v, dict):
            layers = sorted(v)
            d = torch.tensor([float(v[L]) for L in layers], dtype=torch.float64, device=dev)
            dist.all_reduce(d)
            out[k] = {L: float(x) / dist.get_world_size() for L, x in zip(layers, d.tolist(), strict=True)}
    return out
