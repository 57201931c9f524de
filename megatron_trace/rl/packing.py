"""A rollout's samples packed into trainer micro-batches (THD, with the guidance they carry),
and where each response token's log-prob sits in them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..megatron.context import MicroBatchGuidance
from ..megatron.model import pack_sequences
from ..megatron.schedule import MicroBatch
from .ranks import max_over_ranks
from .rollout_batch import RolloutBatch


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch:
    """Samples of a rollout as one trainer micro-batch (`batch`: ids, positions, targets
    [1, T'], T' = T plus sequence padding, THD params, the guidance it carries, padded), and
    where each response token's log-prob sits: index, sample_of (the sample's index in the
    rollout) int64 [R], the rollout's log-probs float32 [R]. `weight` 0 marks a filler
    micro-batch: it runs (the collectives of the other ranks need it) but counts nothing."""

    batch: MicroBatch
    index: torch.Tensor
    sample_of: torch.Tensor
    logp_rollout: torch.Tensor
    weight: float = 1.0


def pack(trainer, batch: RolloutBatch, samples: list[int], records: bool, weight: float = 1.0) -> PackedMicroBatch:
    """The rollout's `samples` (indices) as one micro-batch. `records`: the forward carries the
    guidance records (applied in trace mode; read by flip counters otherwise); routed experts
    ride along always."""
    dev, out = trainer.device, batch.out
    chosen = [out.samples[i] for i in samples]
    seqs = [torch.tensor(list(batch.prompts[s.group_id]) + s.tokens) for s in chosen]
    pad = trainer.sequence_padding(sum(len(q) for q in seqs))
    tokens, positions, psp = pack_sequences(seqs, dev, pad)
    full = MicroBatchGuidance.from_batch(out.guidance, [s.sample_id for s in chosen])
    carried = full if records else MicroBatchGuidance(full.num_tokens, routed_experts=full.routed_experts)
    index, sample_of, offset = [], [], 0  # a response token's log-prob sits at the position before it
    for i, s, q in zip(samples, chosen, seqs, strict=True):
        index += range(offset + s.prompt_len - 1, offset + len(q) - 1)
        sample_of += [i] * len(s.tokens)
        offset += len(q)
    mb = MicroBatch(tokens, positions, torch.roll(tokens, -1, 1), psp, carried.padded(pad, len(seqs[0])))
    return PackedMicroBatch(batch=mb, index=torch.tensor(index, device=dev, dtype=torch.long),
                            sample_of=torch.tensor(sample_of, device=dev, dtype=torch.long),
                            logp_rollout=torch.cat([s.logprobs for s in chosen]).to(dev), weight=weight)


def split_microbatches(lengths: list[int], max_tokens: int, count: int | None = None) -> list[list[int]]:
    """Consecutive samples (by token length) in micro-batches of at most `max_tokens` tokens
    (0: all in one; a longer sample goes alone), split further into `count` micro-batches when
    asked (while some holds two samples or more). Returns lists of sample indices."""
    chunks: list[list[int]] = []
    filled = 0  # tokens in the last chunk
    for i, n in enumerate(lengths):
        if chunks and (not max_tokens or filled + n <= max_tokens):
            chunks[-1].append(i)
            filled += n
        else:
            chunks.append([i])
            filled = n
    while count is not None and len(chunks) < count:
        big = max(range(len(chunks)), key=lambda k: len(chunks[k]))
        if len(chunks[big]) < 2:
            break
        c = chunks.pop(big)
        chunks[big:big] = [c[: len(c) // 2], c[len(c) // 2:]]
    return chunks


def microbatches(trainer, batch: RolloutBatch, max_tokens: int, records: bool) -> list[PackedMicroBatch]:
    """The rollout in micro-batches of at most `max_tokens` tokens (0: one). Across trainer
    ranks every rank runs as many as the busiest (expert and pipeline collectives pair them up):
    a rank with fewer samples than that repeats one, as a filler of weight 0."""
    lengths = [len(batch.prompts[s.group_id]) + len(s.tokens) for s in batch.out.samples]
    own = split_microbatches(lengths, max_tokens)
    count = max_over_ranks(len(own))
    chunks = split_microbatches(lengths, max_tokens, count)
    packed = [pack(trainer, batch, c, records) for c in chunks]
    packed += [pack(trainer, batch, chunks[-1][-1:], records, weight=0.0)] * (count - len(chunks))
    return packed
