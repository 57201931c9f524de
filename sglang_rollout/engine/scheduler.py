"""The scheduler: which sequences run in the next forward, and the KV blocks they hold.

It owns admission (a waiting prompt job is admitted when the worst case of its blocks fits),
block accounting (prompt blocks, forks that share a prompt's full blocks, releases) and the
checks that keep every request admissible into an empty engine. A step is its decodes (running
samples' next tokens) followed by prefill chunks filling the rest of its token budget: the
prompts that finish there, then at most one that goes on in the next step (chunked prefill, as
SGLang's `chunked_prefill_size`: a long prompt never waits for the running samples to drain).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from megatron_trace.model_config import ModelConfig
from megatron_trace.rollout import GroupRequest, SamplingParams

from .config import EngineConfig
from .kv_cache import PagedKVCache
from .model import Segment
from .sampler import sample_key
from .sequence import PromptJob, Sequence, Status


@dataclass(frozen=True, kw_only=True)
class ScheduledStep:
    """One forward's work: `decodes` (sequences feeding their latest token), then `prefills`
    (prompt jobs whose last chunk runs here: their samples draw from this step), then `partial`
    (a prompt job whose prefill goes on in a later step), as `segments` in that order. `lag`:
    the decodes' input tokens are the previous step's draws, still on the device (the segments
    carry placeholders)."""

    decodes: list[Sequence]
    prefills: list[PromptJob]
    segments: list[Segment]
    lag: bool
    partial: PromptJob | None = None

    @property
    def decode_only(self) -> bool:
        return not self.prefills and self.partial is None

    @property
    def sequences(self) -> list[Sequence]:
        """The sequence of each segment, in order."""
        return self.decodes + [job.prompt for job in self.prefills] + ([self.partial.prompt] if self.partial else [])


class Scheduler:
    """Admission and KV-block accounting over `cache` (see the module docstring): the
    sequences use engine_cfg.num_blocks blocks (the cache may hold more: the CUDA graphs' scratch
    block)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, cache: PagedKVCache, share_prompts: bool):
        self.model_cfg, self.engine_cfg, self.cache, self.share_prompts = model_cfg, engine_cfg, cache, share_prompts
        self.capacity = engine_cfg.num_blocks  # KV blocks sequences can use
        self.committed = 0  # worst-case KV blocks of the admitted jobs
        self.waiting: deque[PromptJob] = deque()

    @property
    def context_limit(self) -> int:
        """The longest sequence (prompt + response tokens) the engine can hold."""
        return min(self.model_cfg.max_position_embeddings, self.engine_cfg.block_size * self.capacity)

    def check(self, req: GroupRequest, sampling: SamplingParams) -> str | None:
        """Why `req` cannot run (None: it can): every job that passes fits an empty engine."""
        n = len(req.prompt_ids)
        if n == 0:
            return "empty prompt"
        bad = [t for t in req.prompt_ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            return f"token ids {bad[:5]} outside the vocabulary 0..{self.model_cfg.vocab_size - 1}"
        if req.n < 1:
            return f"n must be >= 1, got {req.n}"
        if n + sampling.max_new_tokens > self.context_limit:
            return (f"prompt of {n} tokens + max_new_tokens {sampling.max_new_tokens} exceeds the context "
                    f"of {self.context_limit} tokens")
        per_job = req.n if self.share_prompts else 1
        need = self._worst_blocks(n, per_job, sampling)
        if need > self.capacity:
            return f"{per_job} samples of this prompt need up to {need} KV blocks; the cache holds {self.capacity}"
        return None

    def add(self, req: GroupRequest, sample_ids: list[str], sampling: SamplingParams) -> None:
        """Queue the prompt job(s) of a checked request: one per group, or one per sample when
        prompts are not shared."""
        children = [Sequence(seq_id=sid, group_id=req.group_id, tokens=list(req.prompt_ids),
                             prompt_len=len(req.prompt_ids), key=sample_key(sampling.seed, sid)) for sid in sample_ids]
        groups = [children] if self.share_prompts else [[c] for c in children]
        for i, kids in enumerate(groups):
            prompt = Sequence(seq_id=f"{req.group_id}/prompt{i}", group_id=req.group_id, tokens=list(req.prompt_ids),
                              prompt_len=len(req.prompt_ids))
            self.waiting.append(PromptJob(prompt=prompt, children=kids, records_prompt=i == 0,
                                          blocks=self._worst_blocks(len(req.prompt_ids), len(kids), sampling)))

    def schedule(self, running: list[Sequence], lag: bool = False) -> ScheduledStep:
        """The next forward: every running sequence's next token, then chunks of the waiting
        prompts, in order, up to the token budget (`max_batch_tokens`) while the cache admits
        their jobs; the last chunk may stop inside a prompt, which goes on first in the next
        step. No prefill with `lag`: the running sequences' tokens are not on the host yet, and a
        step that draws for a prompt's samples would need them."""
        segments = []
        for seq in running:
            n = seq.num_tokens + lag
            self._ensure_blocks(seq, n)
            segments.append(Segment([0 if lag else seq.tokens[-1]], n - 1, seq.block_table))
        prefills, partial = [], None
        budget = self.engine_cfg.max_batch_tokens - len(segments)
        while not lag and self.waiting and budget > 0:
            job = self.waiting[0]
            prompt, done = job.prompt, job.prompt.num_cached
            if done == 0:  # not admitted yet: its worst case must fit beside the admitted jobs'
                if self.committed + job.blocks > self.capacity:
                    break
                self.committed += job.blocks
            chunk = min(prompt.num_tokens - done, budget)
            self._ensure_blocks(prompt, done + chunk)
            segments.append(Segment(prompt.tokens[done:done + chunk], done, prompt.block_table))
            prompt.num_cached, budget = done + chunk, budget - chunk
            if prompt.num_cached < prompt.num_tokens:
                partial = job  # the budget is spent
                break
            prefills.append(self.waiting.popleft())
        if not segments:  # `check` keeps every job admissible into an empty engine
            raise RuntimeError("the scheduler found no work it could run")
        return ScheduledStep(decodes=list(running), prefills=prefills, segments=segments, lag=lag, partial=partial)

    def fork(self, job: PromptJob) -> list[Sequence]:
        """The job's samples start from its prefilled prompt: full KV blocks shared, the partial
        one copied; the prompt's own references are released. Returns the samples (running)."""
        prompt, bs = job.prompt, self.engine_cfg.block_size
        full, partial = divmod(prompt.num_tokens, bs)
        for child in job.children:
            self.cache.allocator.share(prompt.block_table[:full])
            child.block_table = list(prompt.block_table[:full])
            if partial:
                (block,) = self.cache.allocator.allocate(1)
                self.cache.copy_block(prompt.block_table[full], block, partial)
                child.block_table.append(block)
            child.num_cached, child.status = prompt.num_tokens, Status.RUNNING
        self.cache.allocator.release(prompt.block_table)
        return job.children

    def finish(self, seq: Sequence) -> None:
        """Release a finished sample's blocks (and its job's worst case once all its samples are done)."""
        self.cache.allocator.release(seq.block_table)
        seq.block_table = []
        seq.job.unfinished -= 1
        if seq.job.unfinished == 0:
            self.committed -= seq.job.blocks

    def _ensure_blocks(self, seq: Sequence, upto: int) -> None:
        need = math.ceil(upto / self.engine_cfg.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table += self.cache.allocator.allocate(need)

    def _worst_blocks(self, prompt_len: int, samples: int, sampling: SamplingParams) -> int:
        bs = self.engine_cfg.block_size
        own = math.ceil((prompt_len + sampling.max_new_tokens) / bs) - (prompt_len // bs if self.share_prompts else 0)
        return math.ceil(prompt_len / bs) + samples * own
