"""Supervised warm-up (`trace-rl sft`): teach the tiny model the task's format and some answers,
so that RL starts with a reward signal. Cross entropy on the answer tokens only. The
demonstrations may carry near misses (`sft.label_noise`), as imperfect data does, which RL on
the exact reward then has to unlearn."""

from __future__ import annotations

import dataclasses

import torch

from ..megatron.model import pack_sequences
from ..megatron.schedule import MicroBatch
from ..modes import TrainerPrecision


def sft_step(trainer, examples: list[tuple[list[int], list[bool]]],
             precision: TrainerPrecision | str = TrainerPrecision.BF16) -> float:
    """One optimizer step of `trainer` (an `rl.trainer.Trainer` in a phase) on packed examples
    ((tokens, loss mask) pairs); returns the mean loss over masked tokens. The mask marks tokens
    to predict (a token's log-prob sits one before)."""
    dev = trainer.device
    seqs = [torch.tensor(t) for t, _ in examples]
    pad = trainer.sequence_padding(sum(len(q) for q in seqs))
    tokens, positions, psp = pack_sequences(seqs, dev, pad)
    targets = torch.roll(tokens, -1, 1)
    mask = torch.cat([torch.tensor(m[1:] + [False]) for _, m in examples]
                     + [torch.zeros(pad, dtype=torch.bool)]).to(dev)
    trainer.set_precision(precision)

    def loss_fn(i, logp):  # on the last pipeline stage
        loss = -(logp * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss": loss.detach()}  # a float after the schedule (infos_to_host)
    trainer.zero_grad()
    info = trainer.run_microbatches([MicroBatch(tokens, positions, targets, psp)], loss_fn)[0]
    trainer.step()
    return info["loss"]


NEAR_MISSES = (-10, -1, 1, 10)  # a carry or a last digit gone wrong


def with_near_misses(problems: list, rate: float) -> list:
    """`problems` (tasks.Problem) with each answer, at probability `rate`, replaced by a near
    miss: the integer answer plus one of NEAR_MISSES (kept >= 0 when the answer is). Draws from
    torch's global RNG (a run checkpoint restores it). ValueError when an answer is not an integer."""
    if not rate:
        return problems
    picks = torch.rand(len(problems)) < rate
    moves = torch.randint(len(NEAR_MISSES), (len(problems),))
    out = []
    for p, pick, move in zip(problems, picks.tolist(), moves.tolist(), strict=True):
        if pick:
            try:
                value = int(p.answer)
            except ValueError:
                raise ValueError(f"sft.label_noise needs integer answers; {p.prompt!r} has {p.answer!r}") from None
            wrong = value + NEAR_MISSES[move]
            p = dataclasses.replace(p, answer=str(abs(wrong) if value >= 0 else wrong))
        out.append(p)
    return out
