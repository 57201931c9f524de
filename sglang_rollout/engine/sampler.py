"""Temperature / top-k / top-p sampling with one random stream per sample.

Each sample owns a torch.Generator seeded from (seed, sample id), so its tokens do not depend
on which other sequences share its batch or in which order requests came.
"""

from __future__ import annotations

import zlib

import torch

from megatron_trace.rollout import SamplingParams


def sample_stream(seed: int, sample_id: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(sample_id.encode())) % 2**63)


def sample(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """(token, log-probability of it under logits / temperature) from float32 logits [V]."""
    logits_V = logits_V.float().cpu()
    if params.temperature == 0:
        token = int(logits_V.argmax())
        return token, float(torch.log_softmax(logits_V, -1)[token])
    scaled = logits_V / params.temperature
    logp = torch.log_softmax(scaled, -1)
    probs = logp.exp()
    if params.top_k:
        kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p * sorted_p.sum()  # smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
    return token, float(logp[token])
