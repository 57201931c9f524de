"""TraceEngine: continuous batching over a paged (FP4) KV cache, with guidance capture.

Each step runs one forward over every running sequence's next token (decode) plus as many
waiting prompts as the token budget admits (prefill). A GRPO group's prompt is prefilled once;
its samples fork from it, sharing its full KV blocks (the partial last block is copied). When a
sample stops, its last token is fed once more so that routed experts and guidance rows cover
every token the trainer will see.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from trace_kernels.fp4 import quantize

from megatron_trace.checkpoint.audit import table_from_weights
from megatron_trace.guidance import (
    GroupGuidance,
    GuidanceBatch,
    LayerPolicy,
    SampleGuidance,
    capture,
    capture_dense,
)
from megatron_trace.model_config import ModelConfig
from megatron_trace.rollout import (
    GroupRequest,
    RolloutOutput,
    SampleResult,
    SamplingParams,
)

from .config import EngineConfig
from .kv_cache import PagedKVCache
from .model import DecodeGraph, ModelRunner, Segment, map_rows, rows_per_token
from .sampler import check_drawn, draw_rows, sample_key
from .sequence import Sequence, Status
from .weights import EngineWeights

# Batch sizes that get their own decode CUDA graph (a batch runs in the smallest that holds it).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def _host_array(t: torch.Tensor) -> np.ndarray:
    """numpy view of a host tensor (BF16 through its int16 bits: numpy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _host_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(dtype) if dtype == torch.bfloat16 else t


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor started without waiting (into pinned memory; complete
    once an event recorded after it fires); host tensors as they are."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _from_pinned(t: torch.Tensor) -> torch.Tensor:
    """A pageable copy of a pinned host tensor, so that sequences do not hold pinned memory."""
    return t.clone() if t.is_pinned() else t


def _device_index(values: list[int], device) -> torch.Tensor:
    """int64 [len(values)] on `device`, copied without a host synchronisation (a plain copy from
    pageable memory waits for the device's queue)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


@dataclass
class _Step:
    """A launched forward whose results the host has not taken in: its owners (a Sequence, or
    the _PromptJob whose prompt it prefills) and their new-token counts, the draws made from its
    logits ((row, sequence)), the drawn tokens on the device (the next step's input), and host
    copies in flight (drawn tokens and log-probs float64 [2, draws], routed experts [N, layers,
    top_k], captured rows), complete once `done` fires (CUDA)."""

    owners: list
    sizes: list[int]
    draws: list[tuple[int, Sequence]]
    tokens: torch.Tensor | None
    drawn: torch.Tensor | None
    routed: torch.Tensor
    captured: dict
    done: torch.cuda.Event | None
    decode_only: bool


class _PromptJob:
    """A prompt to prefill and the samples that fork from it. `blocks` is its worst case: the
    prompt's blocks during prefill plus each sample's own blocks at full length; jobs are only
    admitted while the worst cases of all admitted jobs fit the cache, so a running sequence
    never finds the cache full."""

    def __init__(self, prompt: Sequence, children: list[Sequence], records_prompt: bool, blocks: int):
        self.prompt, self.children, self.records_prompt, self.blocks = prompt, children, records_prompt, blocks
        self.unfinished = len(children)


class TraceEngine:
    """The built-in rollout backend (megatron_trace.rollout.RolloutBackend)."""

    def __init__(self, model: ModelConfig, config: EngineConfig = EngineConfig(), share_prompts: bool = True):
        self.cfg, self.config, self.share_prompts = model, config, share_prompts
        fp4 = config.precision == "fp4"
        self.weights = EngineWeights(model, fp4, config.device)
        self.cache = PagedKVCache(model.num_layers, config.num_blocks, config.block_size, model.num_key_value_heads,
                                  model.head_dim, fp4, config.device)
        self.runner = ModelRunner(model, self.weights, self.cache, fp4, config.kernels)
        self.guided_layers = frozenset(LayerPolicy.parse(config.guide).select(model.num_layers))
        # dense records come straight from the fused quantize kernel (bits, scales, g); sparse
        # coding needs the rows themselves (their distance to rounding boundaries)
        self._capture_codes = fp4 and config.coding == "dense"
        self.weight_version = -1
        # CUDA graphs for decode steps, one per batch-size bucket, captured on first use; their
        # padding rows write K/V into a cache block kept out of the allocator's reach
        self._graphs: dict[int, DecodeGraph] = {}
        self._graph_pool, self._scratch = None, None
        if config.cuda_graph_max_batch and torch.device(config.device).type == "cuda":
            (self._scratch,) = self.cache.allocator.allocate(1)
            self._graph_pool = torch.cuda.graph_pool_handle()
        self._capacity = config.num_blocks - (self._scratch is not None)  # KV blocks sequences can use
        self._committed = 0  # worst-case KV blocks of the admitted jobs
        self._row_dtypes: dict = {}  # (layer, site) -> torch dtypes of its captured parts
        self._streaming = None  # during generate(on_group=...): (callback, samples per group, groups sent)

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict, version: int) -> None:
        """Load a full state dict (BF16, or FP4 QTensors for the FP4 sites) as `version`.

        Raises ValueError for a version not newer than the current one, or weights that do not
        fit the model (then the old weights stay)."""
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the engine's {self.weight_version}")
        self.weights.load(state_dict)
        self.weight_version = version

    def quantization_table(self) -> dict[str, str]:
        """{HF module: "fp4" | "bf16"} for every linear and KV site (checkpoint.audit's view)."""
        return table_from_weights(self.cfg, lambda name: self.runner.fp4 and self.weights.is_fp4(name),
                                  self.cache.fp4)

    # -- scoring ------------------------------------------------------------------------------
    def _forward_whole(self, tokens: list[int], capture_layers=frozenset()):
        """One full-sequence forward of `tokens`, nothing kept in the cache afterwards."""
        blocks = self.cache.allocator.allocate(math.ceil(len(tokens) / self.config.block_size))
        try:
            return self.runner.forward([Segment(list(tokens), 0, blocks)], capture_layers, all_logits=True)
        finally:
            self.cache.allocator.release(blocks)

    def score(self, tokens: list[int]) -> torch.Tensor:
        """log p(tokens[i + 1] | tokens[:i + 1]) from one full-sequence forward (no sampling,
        nothing kept in the cache): float32 [len(tokens) - 1]."""
        logits, _, _ = self._forward_whole(tokens)
        nxt = torch.tensor(tokens[1:], device=logits.device)
        return torch.log_softmax(logits[:-1], -1).gather(1, nxt[:, None])[:, 0].cpu()

    def activation_amax(self, sequences: list[list[int]]) -> dict[tuple[int, str], float]:
        """The largest |x| at each FP4 site's input (guidance.record.SITES) over full forwards of
        `sequences`: {(layer, site): amax}. Calibrates the static input scales of an FP4 export."""
        amax: dict[tuple[int, str], float] = {}
        for tokens in sequences:
            _, captured, _ = self._forward_whole(tokens, frozenset(range(self.cfg.num_layers)))
            for key, rows in captured.items():
                amax[key] = max(amax.get(key, 0.0), rows.float().abs().max().item())
        return amax

    # -- generation ---------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams, on_group=None) -> RolloutOutput:
        """Every request's samples, in request order, with their guidance. `on_group(output)`, if
        given, also receives each group's RolloutOutput as soon as its last sample finishes (for
        streaming guidance to the trainer while the other groups still generate)."""
        if self.weight_version < 0:
            raise RuntimeError("the engine has no weights yet: call update_weights first")
        self._streaming = None if on_group is None else (on_group, {r.group_id: r.n for r in requests}, set())
        results: dict[str, SampleResult] = {}
        order: list[str] = []
        jobs: deque[_PromptJob] = deque()
        for req in requests:
            ids = [f"{req.group_id}/{i}" for i in range(req.n)]
            order += ids
            error = self._check_request(req, sampling)
            if error:
                for sid in ids:
                    results[sid] = SampleResult(sid, req.group_id, len(req.prompt_ids), [], torch.zeros(0),
                                                "error", self.weight_version, error)
                continue
            children = [Sequence(sid, req.group_id, list(req.prompt_ids), len(req.prompt_ids),
                                 key=sample_key(sampling.seed, sid)) for sid in ids]
            groups = [children] if self.share_prompts else [[c] for c in children]
            for i, kids in enumerate(groups):
                prompt = Sequence(f"{req.group_id}/prompt{i}", req.group_id, list(req.prompt_ids), len(req.prompt_ids))
                job = _PromptJob(prompt, kids, i == 0, self._worst_blocks(len(req.prompt_ids), len(kids), sampling))
                for kid in kids:
                    kid.job = job
                jobs.append(job)
        guidance = GuidanceBatch()
        self._run(jobs, sampling, guidance, results)
        for req in requests:  # groups refused at admission (errors) are streamed last
            self._stream(req.group_id, results, guidance)
        self._streaming = None
        return RolloutOutput([results[sid] for sid in order], guidance)

    def _stream(self, group_id: str, results, guidance) -> None:
        """Hand a finished group to the `on_group` callback, once."""
        if self._streaming is None:
            return
        callback, sizes, sent = self._streaming
        ids = [f"{group_id}/{i}" for i in range(sizes[group_id])]
        if group_id in sent or not all(sid in results for sid in ids):
            return
        sent.add(group_id)
        callback(RolloutOutput([results[sid] for sid in ids], guidance.subset(ids)))

    def _worst_blocks(self, prompt_len: int, samples: int, sampling: SamplingParams) -> int:
        bs = self.config.block_size
        own = math.ceil((prompt_len + sampling.max_new_tokens) / bs) - (prompt_len // bs if self.share_prompts else 0)
        return math.ceil(prompt_len / bs) + samples * own

    def _check_request(self, req: GroupRequest, sampling: SamplingParams) -> str | None:
        n = len(req.prompt_ids)
        if n == 0:
            return "empty prompt"
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            return f"token ids {bad[:5]} outside the vocabulary 0..{self.cfg.vocab_size - 1}"
        if req.n < 1:
            return f"n must be >= 1, got {req.n}"
        limit = min(self.cfg.max_position_embeddings, self.config.block_size * self._capacity)
        if n + sampling.max_new_tokens > limit:
            return (f"prompt of {n} tokens + max_new_tokens {sampling.max_new_tokens} exceeds the context "
                    f"of {limit} tokens")
        if n > self.config.max_batch_tokens:
            return f"prompt of {n} tokens exceeds max_batch_tokens={self.config.max_batch_tokens}"
        per_job = req.n if self.share_prompts else 1
        need = self._worst_blocks(n, per_job, sampling)
        if need > self._capacity:
            return f"{per_job} samples of this prompt need up to {need} KV blocks; the cache holds {self._capacity}"
        return None

    def _ensure_blocks(self, seq: Sequence, upto: int) -> None:
        need = math.ceil(upto / self.config.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table += self.cache.allocator.allocate(need)

    def _run(self, jobs, sampling, guidance, results) -> None:
        """Steps until every admitted job's samples finish. With `config.overlap`, once no prompt
        waits, each decode step is launched before the host takes in the previous one's results:
        its input tokens are the previous step's draws, still on the device, and the GPU runs
        while the host does its bookkeeping. The batches, tokens and records are the same."""
        running: list[Sequence] = []  # samples decoding (or feeding their last token)
        pending: _Step | None = None  # launched, results not taken in yet
        while jobs or running or pending is not None:
            if pending is None:
                pending = self._launch(running, jobs, sampling)
                continue
            ahead = None
            if self.config.overlap and pending.decode_only and not jobs:
                # what the host would schedule next: the samples still running after `pending`
                # (those finishing there feed their last token next, as in the serial loop)
                follow = [seq for _, seq in pending.draws if seq.status is Status.RUNNING]
                ahead = self._launch(follow, jobs, sampling, after=pending) if follow else None
            running = self._take(pending, sampling, guidance, results)
            pending = ahead

    def _launch(self, seqs: list[Sequence], jobs, sampling: SamplingParams, after: _Step | None = None) -> _Step:
        """Schedule a step (the running samples' next tokens, then the waiting prompts the token
        budget and the cache admit), run its forward and draw from its logits, all without
        waiting for the device; the results come back as host copies in flight. `after`: the
        step whose draws are `seqs`' input tokens, not yet taken in (no prompt is admitted then)."""
        lag = after is not None  # each sequence's latest token is still on the device
        segments, owners = [], []
        for seq in seqs:
            n = seq.num_tokens + lag
            self._ensure_blocks(seq, n)
            segments.append(Segment([0 if lag else seq.tokens[-1]], n - 1, seq.block_table))
            owners.append(seq)
        budget = self.config.max_batch_tokens - len(segments)
        while not lag and jobs and len(jobs[0].prompt.tokens) <= budget and \
                self._committed + jobs[0].blocks <= self._capacity:
            job = jobs.popleft()
            self._committed += job.blocks
            self._ensure_blocks(job.prompt, job.prompt.num_tokens)
            segments.append(Segment(job.prompt.tokens, 0, job.prompt.block_table))
            owners.append(job)
            budget -= job.prompt.num_tokens
        if not segments:  # _check_request keeps every job admissible into an empty engine
            raise RuntimeError("the scheduler found no work it could run")
        ids = None
        if lag:  # the draws of `after` that these sequences made, in this step's order
            ids = after.tokens
            if len(seqs) < len(after.draws):
                row = {id(seq): i for i, (_, seq) in enumerate(after.draws)}
                ids = ids[_device_index([row[id(seq)] for seq in seqs], ids.device)]
        decode_only = not any(isinstance(o, _PromptJob) for o in owners)
        graph = self._decode_graph(len(segments)) if decode_only else None
        if graph is not None:
            logits, captured, routed = graph.run(segments, ids)
        else:
            logits, captured, routed = self.runner.forward(segments, self.guided_layers, codes=self._capture_codes,
                                                           ids=ids)
        draws = []  # (logits row, sequence that samples from it)
        for i, owner in enumerate(owners):
            if isinstance(owner, _PromptJob):  # its samples draw their first tokens from the prompt's logits
                draws += [(i, child) for child in owner.children]
            elif owner.status is Status.RUNNING:
                draws.append((i, owner))
        tokens = drawn = None
        if draws:
            rows = [i for i, _ in draws]
            in_order = rows == list(range(len(rows)))  # decode steps: every row, in order
            picked = logits[:len(rows)] if in_order else logits[_device_index(rows, logits.device)]
            tokens, logps = draw_rows(picked, sampling, [seq.key for _, seq in draws],
                                      [len(seq.response) + lag for _, seq in draws], backend=self.runner.backend)
            drawn = _to_host(torch.stack([tokens.double(), logps.double()]))  # ids < 2**53: exact
        # routed experts of every layer as one [tokens, layers, top_k] copy a step, and one slice
        # per sequence (per-layer slices cost 19 ms a step at 48 layers)
        routed = _to_host(torch.stack([routed[layer] for layer in range(self.cfg.num_layers)], 1))
        captured = {key: map_rows(_to_host, rows) for key, rows in captured.items()}  # one copy per layer and site
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return _Step(owners, [len(seg.token_ids) for seg in segments], draws, tokens, drawn, routed, captured, done,
                     decode_only)

    def _take(self, step: _Step, sampling: SamplingParams, guidance, results) -> list[Sequence]:
        """Take in a launched step's results (waiting for its copies): routed experts and
        captured rows to their sequences, prompts forked into their samples, fed-out samples
        finished, drawn tokens appended. Returns the samples that run (or feed) next."""
        if step.done is not None:
            step.done.synchronize()
        routed = _from_pinned(step.routed)
        captured = {key: map_rows(_from_pinned, rows) for key, rows in step.captured.items()}
        pieces = self._split_rows(captured, step.sizes)
        offset, running = 0, []
        for i, (m, owner) in enumerate(zip(step.sizes, step.owners)):
            seq = owner.prompt if isinstance(owner, _PromptJob) else owner
            seq.experts.append(routed[offset:offset + m])
            if pieces:
                seq.rows.append({key: parts[i] for key, parts in pieces.items()})
            offset += m
            if isinstance(owner, _PromptJob):
                running += self._fork(owner, guidance)
            elif seq.status is Status.FINISHED:  # its last token is now fed
                self._finish(seq, results, guidance)
            else:
                running.append(seq)
        if step.draws:
            # a sample that finished in the step before was drawn for too (launched ahead): dropped
            live = {id(seq) for seq in running}
            kept = [(seq, int(t), float(lp)) for (_, seq), t, lp in zip(step.draws, *step.drawn.tolist())
                    if id(seq) in live]
            check_drawn([lp for _, _, lp in kept], len(step.draws))
            for seq, token, logp in kept:
                seq.tokens.append(token)
                seq.logprobs.append(logp)
                if token in sampling.stop_token_ids:
                    seq.status, seq.finish_reason = Status.FINISHED, "stop"
                elif len(seq.response) >= sampling.max_new_tokens:
                    seq.status, seq.finish_reason = Status.FINISHED, "length"
        return running

    def _decode_graph(self, batch: int) -> DecodeGraph | None:
        """The CUDA graph for a decode step of `batch` sequences (the smallest bucket that holds
        it, captured on first use), or None where graphs are off or the batch is too large."""
        limit = self.config.cuda_graph_max_batch
        if self._scratch is None or batch > limit:
            return None
        size = min(next(b for b in GRAPH_BUCKETS + (limit,) if b >= batch), limit)
        if size not in self._graphs:
            max_blocks = math.ceil(min(self.cfg.max_position_embeddings, self.config.block_size * self._capacity)
                                   / self.config.block_size)
            self._graphs[size] = DecodeGraph(self.runner, size, max_blocks, self._scratch, self.guided_layers,
                                             self._graph_pool, codes=self._capture_codes)
        return self._graphs[size]

    def _split_rows(self, captured, sizes: list[int]) -> dict:
        """{(layer, site): one piece per segment} of a step's captured host rows (segments of
        `sizes` tokens, in order), as numpy views: a numpy slice costs a tenth of a torch view,
        and slicing every sequence, layer and site as torch views cost 50 ms a step at 8 guided
        layers and batch 64 (host time). A piece is an array, or (bits, scales, g) arrays."""
        pieces = {}
        bounds = [0]
        for m in sizes:
            bounds.append(bounds[-1] + m)
        for (layer, site), rows in captured.items():
            per = rows_per_token(self.cfg, site)
            parts = rows if isinstance(rows, tuple) else (rows,)
            self._row_dtypes[(layer, site)] = tuple(t.dtype for t in parts)
            arrays = [_host_array(t) for t in parts]
            cut = [(a * per, b * per) for a, b in zip(bounds, bounds[1:])]
            if isinstance(rows, tuple):
                pieces[(layer, site)] = [tuple(x[a:b] for x in arrays) for a, b in cut]
            else:
                pieces[(layer, site)] = [arrays[0][a:b] for a, b in cut]
        return pieces

    def _join_rows(self, key, pieces: list):
        """A sequence's pieces of one (layer, site), concatenated in token order as torch tensors."""
        dtypes = self._row_dtypes[key]
        if isinstance(pieces[0], tuple):
            return tuple(_host_tensor(np.concatenate(parts), d) for parts, d in zip(zip(*pieces), dtypes, strict=True))
        return _host_tensor(np.concatenate(pieces), dtypes[0])

    def _fork(self, job: _PromptJob, guidance) -> list[Sequence]:
        """Samples start from the prefilled prompt: full KV blocks shared, the partial one copied.
        Each then draws its first token from the prompt's last logits."""
        prompt, bs = job.prompt, self.config.block_size
        full = prompt.num_tokens // bs
        partial = prompt.num_tokens % bs
        if job.records_prompt:
            group = GroupGuidance(prompt.group_id, prompt.prompt_len,
                                  self._records(prompt, prompt.group_id), self._experts(prompt))
            guidance.add_group(group)
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

    def _finish(self, seq: Sequence, results, guidance) -> None:
        self.cache.allocator.release(seq.block_table)
        seq.block_table = []
        seq.job.unfinished -= 1
        if seq.job.unfinished == 0:
            self._committed -= seq.job.blocks
        results[seq.seq_id] = SampleResult(seq.seq_id, seq.group_id, seq.prompt_len, seq.response,
                                           torch.tensor(seq.logprobs, dtype=torch.float32), seq.finish_reason,
                                           self.weight_version)
        guidance.add_sample(SampleGuidance(seq.seq_id, seq.group_id, len(seq.response), self.weight_version,
                                           self._records(seq, seq.seq_id), self._experts(seq)))
        self._stream(seq.group_id, results, guidance)

    def _experts(self, seq: Sequence) -> dict[int, torch.Tensor]:
        routed = torch.cat(seq.experts)  # [tokens, layers, top_k]
        return {layer: routed[:, layer].contiguous() for layer in range(self.cfg.num_layers)}

    def _records(self, seq: Sequence, owner: str) -> dict:
        records = {}
        for layer, site in seq.rows[0] if seq.rows else ():
            kept = self._join_rows((layer, site), [step[(layer, site)] for step in seq.rows])
            header = dict(model_id=self.config.model_id, layer=layer, site=site, sample_id=owner,
                          weight_version=self.weight_version, policy=self.config.guide)
            if isinstance(kept, tuple):  # (bits, scales, g) from the fused quantize kernel
                records[(layer, site)] = capture_dense(*kept, **header)
                continue
            records[(layer, site)] = capture(
                kept, quantize(kept, "nvfp4", scale="row"), **header, coding=self.config.coding,
                **({} if self.config.coding == "dense" else {"tau": self.config.tau,
                                                            "scale_coding": self.config.scale_coding}))
        return records
