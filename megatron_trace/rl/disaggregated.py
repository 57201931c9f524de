"""`trace-rl train` under torchrun: trainer ranks run Megatron, engine ranks run rollout engines.

The RL loop is the colocated one (`rl.step`); the trainer ranks see the engines through
`RemoteEngine`, a RolloutBackend whose calls travel over the `Bridge`:
    generate:        trainer rank 0 splits the requests into contiguous shares, one per engine;
                     each engine streams every finished group (samples, log-probs, routed
                     experts, guidance records) to the trainer ranks whose data-parallel rank
                     trains on it (contiguous shares of the step's groups) while the other
                     groups still generate, then an end marker;
    update_weights:  every trainer rank quantizes and packs the weights it holds into buckets
                     (`rl.weight_sync`); rank 0 tells each engine the version and which ranks
                     send how many buckets, the senders send theirs straight to every engine,
                     which writes them in place and answers ("ok", version) or an error.
Engine ranks run `serve_engine` until the trainers say stop. Gradients are reduced across the
trainer's groups by Megatron's DDP (`megatron.optimizer`).
Trainer layouts: any TP / EP / PP / DP (the step runs Megatron's pipeline schedule).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..guidance import GuidanceBatch
from ..modes import EnginePrecision
from ..rollout import GroupRequest, RolloutOutput, SamplingParams, close_backend
from .bridge import Bridge
from .ranks import data_parallel


def dp_share(num_groups: int, dp_rank: int, dp_size: int) -> range:
    """The groups data-parallel rank `dp_rank` trains on: a contiguous share, the first
    `num_groups % dp_size` ranks taking one more."""
    base, extra = divmod(num_groups, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (dp_rank < extra))


class RemoteEngine:
    """The RolloutBackend the trainer ranks call (see module docstring)."""

    def __init__(self, bridge: Bridge, precision: EnginePrecision | str, guide: str, coding: str):
        self.bridge, self.precision, self.weight_version = bridge, EnginePrecision(precision), -1
        if dist.get_rank() == 0:  # every engine (re)builds its engine for these settings
            for e in bridge.roles.engines:
                bridge.send(("configure", precision, guide, coding), e)
        self.dp_rank, self.dp_size, _ = data_parallel()
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
        """`state_dict`: the full weights on trainer rank 0 (None on the others), sent from there
        in buckets. Collective over the trainer ranks."""
        from ..config import DistSection
        from ..weight_buckets import state_dict_buckets

        buckets = state_dict_buckets(state_dict or {}, int(DistSection.sync_bucket_mb * 2**20),
                                     fp4=self.precision is EnginePrecision.FP4)
        self.update_weights_from_buckets(buckets, version)

    def update_weights_from_buckets(self, buckets, version: int) -> None:
        """Every trainer rank's `buckets` (a sized iterable, made as iterated) to every engine:
        the bucket counts are gathered first (no collective runs between the sends), rank 0
        announces the update, each rank sends its buckets, rank 0 collects the engines' answers.
        Collective over the trainer ranks; RuntimeError on every rank when an engine refused."""
        engines, rank0 = self.bridge.roles.engines, dist.get_rank() == 0
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(buckets))
        if rank0:
            senders = [(rank, n) for rank, n in enumerate(counts) if n]
            for e in engines:
                self.bridge.send(("weights", version, senders), e)
        for flat in buckets:
            flat = flat.to(self.bridge.device)
            for e in engines:
                self.bridge.send_buffer(flat, e)
            del flat
        refused = [None]
        if rank0:
            replies = [(e, self.bridge.recv(e)) for e in engines]
            refused = [next((f"engine rank {e} refused weights version {version}: {reply}"
                             for e, reply in replies if reply != ("ok", version)), None)]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is not None:
            raise RuntimeError(refused[0])
        self.weight_version = version


def serve_engine(bridge: Bridge, make_engine) -> None:
    """Answer the trainers' requests until they send stop, with the engine that
    make_engine(precision, guide, coding) builds when they configure one (a RolloutBackend)."""
    engine = None
    while True:
        msg = bridge.recv(0)
        if msg[0] == "stop":
            close_backend(engine)
            return
        if msg[0] == "configure":
            close_backend(engine)  # free the old one first
            engine = None
            engine = make_engine(*msg[1:])
            continue
        if msg[0] == "weights":  # buckets from each sender in turn, written as they arrive
            _, version, senders = msg
            incoming = (bridge.recv_buffer(rank) for rank, count in senders for _ in range(count))
            try:
                engine.update_weights_from_buckets(incoming, version)
                reply = ("ok", version)
            except ValueError as e:
                reply = ("error", str(e))
            for _ in incoming:  # the buckets still on their way after a refusal
                pass
            bridge.send(reply, 0)
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


SUMMED = ("weight_sync_bytes",)  # each rank reports what it sent: the job's figure is the sum


def average_metrics(m: dict) -> dict:
    """Every numeric metric (and per-layer dict) averaged over the trainer ranks (SUMMED ones summed)."""
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
    flat = {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}
    keys = sorted(k for k in flat if k not in SUMMED)
    t = torch.tensor([flat[k] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    out = dict(m) | {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist(), strict=True)}
    for k in SUMMED:
        if k in flat:
            x = torch.tensor(flat[k], dtype=torch.float64, device=dev)
            dist.all_reduce(x)
            out[k] = float(x)
    for k, v in m.items():
        if isinstance(v, dict):
            layers = sorted(v)
            d = torch.tensor([float(v[L]) for L in layers], dtype=torch.float64, device=dev)
            dist.all_reduce(d)
            out[k] = {L: float(x) / dist.get_world_size() for L, x in zip(layers, d.tolist(), strict=True)}
    return out
