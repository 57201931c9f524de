"""The `budget:B` guidance policy: guide the layers that flip most, within B bytes per token.

At the start of RL the run measures, on one rollout of calibration prompts, each layer's flip
rate (the trainer's round-to-nearest codes against the engine's, `rl.mismatch`) and the bytes
per token its guidance costs in the run's coding; `LayerPolicy.select` then picks layers in
decreasing flip rate while they fit. The choice is kept in the run's checkpoints.
"""

from __future__ import annotations

from ..guidance import GuidanceBatch, LayerPolicy
from ..rollout import GroupRequest, SamplingParams
from .mismatch import run_mismatch


def bytes_per_token_by_layer(guidance: GuidanceBatch, num_layers: int) -> dict[int, float]:
    """Guidance record bytes per token of each layer (prompt records counted once per group)."""
    per_layer = dict.fromkeys(range(num_layers), 0.0)
    for owner in (*guidance.groups.values(), *guidance.samples.values()):
        for (layer, _site), rec in owner.records.items():
            per_layer[layer] += rec.nbytes
    tokens = max(1, guidance.num_tokens)
    return {layer: b / tokens for layer, b in per_layer.items()}


def resolve_budget(policy: str, trainer, make_engine, state_dict: dict, prompts: list[tuple[int, ...]],
                   coding: str, samples_per_prompt: int, sampling: SamplingParams, num_layers: int):
    """("layers:i,j" or "none", {layer: flip rate}, {layer: bytes per token}) for `policy`."""
    flips = run_mismatch(trainer, make_engine, state_dict, prompts, modes=("fp4-qat",),
                         samples_per_prompt=samples_per_prompt, sampling=sampling)["fp4-qat"]["flip_rate_by_layer"]
    engine = make_engine("fp4", "all", coding)
    engine.update_weights(state_dict, 0)
    requests = [GroupRequest(f"budget-p{i}", tuple(p), samples_per_prompt) for i, p in enumerate(prompts)]
    cost = bytes_per_token_by_layer(engine.generate(requests, sampling).guidance, num_layers)
    layers = LayerPolicy.parse(policy).select(num_layers, flips, cost)
    return ("layers:" + ",".join(map(str, layers)) if layers else "none"), flips, cost
