"""A sequence being generated (its tokens, KV blocks, random stream and recorded rows), and the
prompt job that a GRPO group's samples fork from."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(kw_only=True)
class Sequence:
    """A prompt or a sample. A group's prompt is a sequence of its own, prefilled once; each
    sample forks from it (sharing its full KV blocks) and then decodes."""

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
    # its captured rows and routed experts live in the generate call's RowStore: its slot there
    # (-1: none yet) and how many tokens of rows it holds
    row_slot: int = -1
    rows_stored: int = 0
    job: PromptJob | None = None  # the prompt job a sample forked from

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def response(self) -> list[int]:
        """A copy of the response tokens (O(length): use `num_response` for its length)."""
        return self.tokens[self.prompt_len:]

    @property
    def num_response(self) -> int:
        # each decode step asks every sequence for this twice; slicing `response` to get it cost
        # O(length) each time: 2.3-5.3 ms of host time a step at batch 64 and 8.7k tokens on a
        # 2-core CPU (bench/engine_host_step.py)
        return len(self.tokens) - self.prompt_len


@dataclass(kw_only=True)
class PromptJob:
    """A prompt to prefill and the samples that fork from it. `blocks` is its worst case: the
    prompt's blocks during prefill plus each sample's own blocks at full length (the scheduler
    admits jobs only while the worst cases of all admitted jobs fit the cache, so a running
    sequence never finds the cache full). `records_prompt`: this job's prompt guidance is the
    group's (with unshared prompts, the first job's)."""

    prompt: Sequence
    children: list[Sequence]
    records_prompt: bool
    blocks: int
    unfinished: int = -1  # samples not finished yet

    def __post_init__(self) -> None:
        if self.unfinished < 0:
            self.unfinished = len(self.children)
        for child in self.children:
            child.job = self
