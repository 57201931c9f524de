"""Supervised warm-up (`trace-rl sft`): teach the tiny model the task's format and some answers,
so that RL starts with a reward signal. Cross entropy on the answer tokens only."""

from __future__ import annotations

import torch

from ..megatron.model import (
    pack_sequences,
    sequence_padding,
    set_precision,
)
from ..megatron.schedule import run_microbatch
from ..modes import TrainerPrecision


def sft_step(trainer, optimizer, examples: list[tuple[list[int], list[bool]]],
             precision: TrainerPrecision | str = TrainerPrecision.BF16) -> float:
    """One step of `optimizer` (the trainer's `megatron.optimizer.TrainerOptimizer`) on packed
    examples ((tokens, loss mask) pairs); returns the mean loss over masked tokens. The mask
    marks tokens to predict (a token's log-prob sits one before)."""
    dev = next(trainer.parameters()).device
    seqs = [torch.tensor(t) for t, _ in examples]
    pad = sequence_padding(sum(len(q) for q in seqs))
    tokens, positions, psp = pack_sequences(seqs, dev, pad)
    targets = torch.roll(tokens, -1, 1)
    mask = torch.cat([torch.tensor(m[1:] + [False]) for _, m in examples]
                     + [torch.zeros(pad, dtype=torch.bool)]).to(dev)
    set_precision(trainer, precision)

    def loss_fn(logp):  # on the last pipeline stage
        loss = -(logp * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss": float(loss.detach())}
    optimizer.zero_grad()
    info = run_microbatch(optimizer.ddp, tokens, positions, targets, psp, loss_fn)
    optimizer.step()
    return info["loss"]
