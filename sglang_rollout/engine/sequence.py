"""A sequence being generated: its tokens, KV blocks, random stream and recorded rows."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """prompt tokens are shared by the samples of a group: the group's prompt sequence is
    prefilled once and each sample forks from it (sharing its full KV blocks)."""

    seq_id: str
    group_id: str
    tokens: list[int]
    prompt_len: int
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    logprobs: list[float] = field(default_factory=list)
    key: int = 0  # its random stream (sampler.sample_key)
    finish_reason: str | None = None
    # per forward, in token order: {(layer, site): this sequence's captured rows [r, K] (or their
    # (bits, scales, g))}
    rows: list = field(default_factory=list)
    experts: list = field(default_factory=list)  # routed expert chunks [r, layers, top_k], in token order
    job: object = None  # the prompt job a sample forked from

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def response(self) -> list[int]:
        return self.tokens[self.prompt_len:]
