"""The `budget:B` guidance policy: guide the layers that flip most, within B bytes per token.

At the start of RL the run measures, on one rollout of calibration prompts with dense guidance
on every layer, each layer's flip rate (the trainer's round-to-nearest codes against the
engine's, summed over trainer ranks) and the bytes per token its guidance costs in the run's
coding; `LayerPolicy.select` then picks layers in decreasing flip rate while they fit. The
choice is kept in the run's checkpoints.
"""

from __future__ import annotations

import dataclasses

from ..config import DistSection, RLSection
from ..guidance import GuidanceBatch, LayerPolicy
from ..modes import EnginePrecision, RunMode
from ..rollout import SamplingParams, close_backend
from .mismatch import FlipCounter
from .ranks import distributed_trainer
from .rollout_batch import rollout
from .step import response_logprobs
from .weight_sync import sync_weights


def bytes_per_token_by_layer(guidance: GuidanceBatch, num_layers: int) -> dict[int, float]:
    """Guidance record bytes per token of each layer (prompt records counted once per group)."""
    per_layer = dict.fromkeys(range(num_layers), 0.0)
    for owner in (*guidance.groups.values(), *guidance.samples.values()):
        for (layer, _site), rec in owner.records.items():
            per_layer[layer] += rec.nbytes
    tokens = max(1, guidance.num_tokens)
    return {layer: b / tokens for layer, b in per_layer.items()}


def resolve_budget(rl: RLSection, trainer, make_engine, prompts: list[tuple[int, ...]], sampling: SamplingParams,
                   num_layers: int, sync_bucket_mb: float = DistSection.sync_bucket_mb):
    """("layers:i,j" or "none", {layer: flip rate}, {layer: bytes per token}) for rl.guide's
    budget in rl.coding, on any trainer layout (every trainer rank counts its own rows; the
    counts are summed). The measurement engines get the weights in buckets of sync_bucket_mb MiB."""
    policy, coding = rl.guide, rl.coding
    measure = dataclasses.replace(rl, mode=RunMode.FP4_QAT, dynamic_sampling=False)
    engine = make_engine(EnginePrecision.FP4, "all", "dense")
    sync_weights(trainer, engine, 0, sync_bucket_mb)
    batch = rollout(engine, prompts, lambda prompt, response: 0.0, rl.group_size, sampling, -1)
    close_backend(engine)
    counter = FlipCounter()
    response_logprobs(trainer, batch, measure, observer=counter)
    flips = counter.rates(num_layers if distributed_trainer() else None)["flip_rate_by_layer"]
    guidance = batch.out.guidance
    if coding != "dense":  # what the run's coding costs
        engine = make_engine(EnginePrecision.FP4, "all", coding)
        sync_weights(trainer, engine, 0, sync_bucket_mb)
        guidance = rollout(engine, prompts, lambda prompt, response: 0.0, rl.group_size, sampling, -1).out.guidance
        close_backend(engine)
    cost = bytes_per_token_by_layer(guidance, num_layers)
    layers = LayerPolicy.parse(policy).select(num_layers, flips, cost)
    return ("layers:" + ",".join(map(str, layers)) if layers else "none"), flips, cost
