"""What the RL loop asks of a rollout backend, and what it gets back.

The built-in engine (`sglang_rollout.engine.TraceEngine`) implements `RolloutBackend`; an SGLang
backend will implement the same protocol for large runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .guidance import GuidanceBatch
from .modes import EnginePrecision


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature: 0 means greedy. top_p: nucleus mass in (0, 1]. top_k: 0 means off.
    max_new_tokens: response length limit. stop_token_ids: generation ends after one of them.
    seed: with the same seed, weights and requests, the same tokens (whatever the batching)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GroupRequest:
    """One prompt and how many samples to draw from it (a GRPO group)."""

    group_id: str
    prompt_ids: tuple[int, ...]
    n: int = 1



def check_group_ids(requests: list[GroupRequest]) -> None:
    """ValueError naming the group ids that repeat within one generate call (sample ids, and
    the guidance keyed by them, would collide)."""
    ids = [req.group_id for req in requests]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"group ids repeat within one generate call: {repeated}")

@dataclass(kw_only=True)
class SampleResult:
    """One generated sample.

    tokens: the response token ids. logprobs: float32 [len(tokens)], log-probability of each
    sampled token under the engine's own distribution (logits / temperature, before top-p/top-k).
    finish_reason: "stop", "length" or "error" (then `error` says why and tokens are empty).
    """

    sample_id: str
    group_id: str
    prompt_len: int
    tokens: list[int]
    logprobs: torch.Tensor
    finish_reason: str
    weight_version: int
    error: str | None = None


@dataclass
class RolloutOutput:
    """Samples in request order (group by group), and their guidance: routed experts of every
    MoE layer for every token, and records for the layers the guidance policy selects (prompt
    records once per group)."""

    samples: list[SampleResult]
    guidance: GuidanceBatch = field(default_factory=GuidanceBatch)


class RolloutBackend(Protocol):
    """A rollout engine as the RL loop drives it (tests/sglang_rollout/test_backend_contract.py
    is the contract every backend passes). `precision`: what it runs (the weight sync packs FP4
    sites for an FP4 engine); `weight_version`: of the weights it holds (-1: none yet)."""

    precision: EnginePrecision
    weight_version: int

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights (full Megatron key names; BF16 tensors, or FP4 packed as QTensor)
        in place and take `version` (which must be newer)."""

    def update_weights_from_buckets(self, buckets: Iterable[torch.Tensor], version: int) -> None:
        """Take `version` from flat weight buckets (`megatron_trace.weight_buckets`: whole weights
        or slices of them, FP4 sites packed), consumed as they arrive. The version is committed
        only once every weight arrived complete; ValueError naming the weight for a bucket that
        does not fit or an incomplete update, and a backend that already wrote part of it
        refuses to generate until a complete version arrives. Under torchrun every trainer rank
        calls it with the buckets it sends (`rl.weight_sync`)."""

    def generate(self, requests: list[GroupRequest], sampling: SamplingParams, on_group=None) -> RolloutOutput:
        """Generate every request's samples; a bad request fails alone (finish_reason "error").
        on_group(output), if given, receives each group's output as soon as it is complete."""


def release_backend_memory(engine) -> None:
    """Let a backend that shares the trainer's GPU give its memory back while the trainer trains
    (`release_memory()`: the SGLang backend colocated); others keep theirs. None is allowed."""
    release = getattr(engine, "release_memory", None)
    if release is not None:
        release()


def resume_backend_memory(engine) -> None:
    """Take back what `release_backend_memory` gave (`resume_memory()`); the weight sync that
    follows sends every weight again."""
    resume = getattr(engine, "resume_memory", None)
    if resume is not None:
        resume()


def close_backend(engine) -> None:
    """Stop a backend's processes and free what it holds, when it has any (`shutdown()`: the
    SGLang backend's host process; the built-in engine lives in this process and has none).
    Idempotent; None is allowed."""
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
