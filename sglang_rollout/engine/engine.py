"""TraceEngine: continuous batching over a paged (FP4) KV cache, with guidance capture.

Each step runs one forward over every running sequence's next token (decode) plus chunks of
the waiting prompts up to the token budget (chunked prefill): schedule (`Scheduler`) -> launch (the
forward and the draws, without waiting for the device) -> take (results to their sequences and
the `RolloutCollector`). A GRPO group's prompt is prefilled once; its samples fork from it,
sharing its full KV blocks (the partial last block is copied). When a sample stops, its last
token is fed once more so that routed experts and guidance rows cover every token the trainer
will see.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megatron_trace.checkpoint.audit import table_from_weights
from megatron_trace.guidance import LayerPolicy, expert_id_dtype, sparse_parts_of_dense
from megatron_trace.model_config import ModelConfig
from megatron_trace.modes import EnginePrecision
from megatron_trace.rollout import GroupRequest, RolloutOutput, SamplingParams, check_group_ids
from megatron_trace.weight_buckets import Coverage, read_bucket

from .collector import RolloutCollector
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .kv_cache import PagedKVCache
from .model import ModelRunner, Segment, keep_codes, map_rows
from .sampler import check_drawn, draw_rows
from .scheduler import ScheduledStep, Scheduler
from .sequence import PromptJob, Sequence, Status
from .weights import EngineWeights


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor started without waiting (into pinned memory; complete
    once an event recorded after it fires); host tensors as they are."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _keep_sparse(x_RK: torch.Tensor, kept: tuple[torch.Tensor, ...], *, tau: float,
                 scale_coding: str) -> tuple[torch.Tensor, ...]:
    """The sparse coding's `RowKeep`: `guidance.sparse_parts` of rows x_RK [R, K] from the fused
    quantize kernel's (bits, scales, g) (a second quantization of every captured site, eager after
    each step, was the sparse engine's extra device work). No host synchronisation."""
    return sparse_parts_of_dense(x_RK, *kept, tau=tau, scale_coding=scale_coding)


def _device_index(values: list[int], device) -> torch.Tensor:
    """int64 [len(values)] on `device`, copied without a host synchronisation (a plain copy from
    pageable memory waits for the device's queue)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


@dataclass(frozen=True, kw_only=True)
class LaunchedStep:
    """A launched forward whose results the host has not taken in: the scheduled work, each
    segment's new-token count, the draws made from its logits ((row, sequence)), the drawn
    tokens on the device (the next step's input), and host copies in flight (drawn tokens and
    log-probs float64 [2, draws], routed experts [N, layers, top_k] in expert_id_dtype, captured rows), complete
    once `done` fires (CUDA)."""

    work: ScheduledStep
    sizes: list[int]
    draws: list[tuple[int, Sequence]]
    tokens: torch.Tensor | None
    drawn: torch.Tensor | None
    routed: torch.Tensor
    captured: dict
    done: torch.cuda.Event | None


class TraceEngine:
    """The built-in rollout backend (megatron_trace.rollout.RolloutBackend)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig = EngineConfig(), share_prompts: bool = True):
        model_cfg.require_built("the built-in engine", "engine")
        self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
        fp4 = engine_cfg.precision is EnginePrecision.FP4
        self.weights = EngineWeights(model_cfg, fp4, engine_cfg.device)
        # CUDA graphs for decode steps; their padding rows write K/V into one more cache block,
        # beyond the num_blocks the sequences use
        # (MLA's attention reads each sequence's cache on the host's schedule: no graphs)
        graphs = (bool(engine_cfg.cuda_graph_max_batch) and torch.device(engine_cfg.device).type == "cuda"
                  and not model_cfg.mla)
        self.cache = PagedKVCache.for_model(model_cfg, engine_cfg.num_blocks + graphs, engine_cfg.block_size, fp4,
                                            engine_cfg.device)
        self.runner = ModelRunner(model_cfg, self.weights, self.cache, fp4, engine_cfg.kernels)
        self.guided_layers = frozenset(LayerPolicy.parse(engine_cfg.guide).select(model_cfg.num_layers))
        # what a captured site keeps, computed in the forward (inside the decode graphs too) from
        # the fused quantize kernel's (bits, scales, g): dense records take them as they are,
        # sparse records add which elements lie near a rounding boundary (guidance.sparse_parts)
        self._keep = None
        if fp4:
            self._keep = keep_codes if engine_cfg.coding == "dense" else functools.partial(
                _keep_sparse, tau=engine_cfg.tau, scale_coding=engine_cfg.scale_coding)
        self.weight_version = -1
        self._torn: str | None = None  # why the weights are a mix of versions (an update failed part-way)
        self._expert_ids = expert_id_dtype(model_cfg.num_experts)
        self.graphs = None
        scratch = self.cache.allocator.allocate(1)[0] if graphs else None
        self.scheduler = Scheduler(model_cfg, engine_cfg, self.cache, share_prompts)
        if graphs:
            self.graphs = DecodeGraphs(self.runner, engine_cfg.cuda_graph_max_batch, self.scheduler.context_limit,
                                       scratch, self.guided_layers, keep=self._keep)

    @property
    def precision(self) -> EnginePrecision:
        return self.engine_cfg.precision

    # -- weights ------------------------------------------------------------------------------
    def capture_graphs(self) -> None:
        """Capture every decode CUDA graph now rather than on first use (a no-op without graphs).
        Needs weights loaded: the capture runs the model."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def update_weights(self, state_dict, version: int) -> None:
        """Load a full state dict (BF16, or FP4 QTensors for the FP4 sites) as `version`.

        Raises ValueError for a version not newer than the current one, or weights that do not
        fit the model (then the old weights stay)."""
        self._check_newer(version)
        self.weights.load(state_dict)
        self._torn, self.weight_version = None, version

    def update_weights_from_buckets(self, buckets, version: int) -> None:
        """Take `version` from weight buckets (megatron_trace.weight_buckets) as they arrive:
        each bucket checked whole, then written into the weights in place (so an update costs a
        bucket of memory); the version is committed once every weight has arrived complete,
        each slice exactly once.

        Raises ValueError (naming the weight) for a version not newer than the current one, a
        bucket that does not fit, or an update that ends incomplete. Until a bucket has been
        written the old weights stay; after that a failed (or interrupted) update leaves the
        engine refusing to generate until a complete version arrives."""
        self._check_newer(version)
        coverage = Coverage(self.weights.shapes, self.weights.is_fp4)
        try:
            for flat in buckets:
                self._write_bucket(flat, coverage, version)
                del flat  # before the next one arrives
            coverage.check_complete()
        except BaseException as e:
            if self._torn is not None:
                self._torn = f"the update to weight version {version} failed part-way ({e})"
            raise
        self._torn, self.weight_version = None, version

    def _write_bucket(self, flat, coverage: Coverage, version: int) -> None:
        pieces = read_bucket(flat)
        coverage.add(pieces)  # the whole bucket checked before any of it is written
        self._torn = f"the update to weight version {version} stopped part-way"
        for piece, parts in pieces:
            self.weights.write(piece, parts)

    def _check_newer(self, version: int) -> None:
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the engine's {self.weight_version}")

    def quantization_table(self) -> dict[str, str]:
        """{HF module: "fp4" | "bf16"} for every linear and KV site (checkpoint.audit's view)."""
        return table_from_weights(self.model_cfg, lambda name: self.runner.fp4 and self.weights.is_fp4(name),
                                  self.cache.fp4)

    # -- scoring ------------------------------------------------------------------------------
    def _forward_whole(self, tokens: list[int], capture_layers=frozenset()):
        """One full-sequence forward of `tokens`, nothing kept in the cache afterwards."""
        blocks = self.cache.allocator.allocate(math.ceil(len(tokens) / self.engine_cfg.block_size))
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
            _, captured, _ = self._forward_whole(tokens, frozenset(range(self.model_cfg.num_layers)))
            for key, rows in captured.items():
                amax[key] = max(amax.get(key, 0.0), rows.float().abs().max().item())
        return amax

    # -- generation ---------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams, on_group=None) -> RolloutOutput:
        """Every request's samples, in request order, with their guidance. `on_group(output)`, if
        given, also receives each group's RolloutOutput as soon as its last sample finishes (for
        streaming guidance to the trainer while the other groups still generate)."""
        if self._torn is not None:
            raise RuntimeError(f"the engine's weights are a mix of versions: {self._torn}; it generates again "
                               "once a complete version arrives")
        if self.weight_version < 0:
            raise RuntimeError("the engine has no weights yet: call update_weights first")
        check_group_ids(requests)
        collector = RolloutCollector(self.model_cfg, self.engine_cfg, self.weight_version, requests, on_group,
                                     sampling.max_new_tokens)
        for req in requests:
            error = self.scheduler.check(req, sampling)
            if error:
                collector.fail(req, error)
            else:
                self.scheduler.add(req, collector.sample_ids(req), sampling)
        self._run(sampling, collector)
        return collector.output()

    def _run(self, sampling: SamplingParams, collector: RolloutCollector) -> None:
        """Steps until every admitted job's samples finish: schedule -> launch -> take. With
        `overlap`, once no prompt waits, each decode step is launched before the host takes in
        the previous one's results: its input tokens are the previous step's draws, still on the
        device, and the GPU runs while the host does its bookkeeping. The batches, tokens and
        records are the same."""
        running: list[Sequence] = []  # samples decoding (or feeding their last token)
        pending: LaunchedStep | None = None  # launched, results not taken in yet
        while self.scheduler.waiting or running or pending is not None:
            if pending is None:
                pending = self._launch(self.scheduler.schedule(running), sampling)
                continue
            ahead = None
            if self.engine_cfg.overlap and pending.work.decode_only and not self.scheduler.waiting:
                # what the host would schedule next: the samples still running after `pending`
                # (those finishing there feed their last token next, as in the serial loop)
                follow = [seq for _, seq in pending.draws if seq.status is Status.RUNNING]
                if follow:
                    ahead = self._launch(self.scheduler.schedule(follow, lag=True), sampling, after=pending)
            running = self._take(pending, sampling, collector)
            pending = ahead

    def _launch(self, work: ScheduledStep, sampling: SamplingParams, after: LaunchedStep | None = None) -> LaunchedStep:
        """Run the scheduled forward and draw from its logits, all without waiting for the device;
        the results come back as host copies in flight. `after`: the step whose draws are the
        decodes' input tokens, not yet taken in (`work.lag`)."""
        ids = None
        if after is not None:  # the draws of `after` that these sequences made, in this step's order
            ids = after.tokens
            if len(work.decodes) < len(after.draws):
                row = {id(seq): i for i, (_, seq) in enumerate(after.draws)}
                ids = ids[_device_index([row[id(seq)] for seq in work.decodes], ids.device)]
        graph = self.graphs.get(len(work.segments)) if self.graphs is not None and work.decode_only else None
        if graph is not None:
            logits, captured, routed = graph.run(work.segments, ids)
        else:
            logits, captured, routed = self.runner.forward(work.segments, self.guided_layers, keep=self._keep,
                                                           ids=ids)
        # (logits row, sequence that samples from it): running decodes, then each prefill's samples
        draws = [(i, seq) for i, seq in enumerate(work.decodes) if seq.status is Status.RUNNING]
        for j, job in enumerate(work.prefills):
            draws += [(len(work.decodes) + j, child) for child in job.children]
        tokens = drawn = None
        if draws:
            rows = [i for i, _ in draws]
            in_order = rows == list(range(len(rows)))  # decode steps: every row, in order
            picked = logits[:len(rows)] if in_order else logits[_device_index(rows, logits.device)]
            tokens, logps = draw_rows(picked, sampling, [seq.key for _, seq in draws],
                                      [seq.num_response + work.lag for _, seq in draws], backend=self.runner.backend)
            drawn = _to_host(torch.stack([tokens.double(), logps.double()]))  # ids < 2**53: exact
        # routed experts of every layer as one [tokens, layers, top_k] copy a step, and one slice
        # per sequence (per-layer slices cost 19 ms a step at 48 layers), in the smallest integer
        # type that holds the ids (as they travel to the trainer)
        routed = _to_host(torch.stack([routed[layer] for layer in self.model_cfg.moe_layers], 1)
                          .to(self._expert_ids))
        captured = {key: map_rows(_to_host, rows) for key, rows in captured.items()}  # one copy per layer and site
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(work=work, sizes=[len(seg.token_ids) for seg in work.segments], draws=draws, tokens=tokens,
                            drawn=drawn, routed=routed, captured=captured, done=done)

    def _take(self, step: LaunchedStep, sampling: SamplingParams, collector: RolloutCollector) -> list[Sequence]:
        """Take in a launched step's results (waiting for its copies): routed experts and
        captured rows to their sequences, prompts forked into their samples, fed-out samples
        finished, drawn tokens appended. Returns the samples that run (or feed) next."""
        if step.done is not None:
            step.done.synchronize()
        collector.add_rows(step.captured, step.routed, list(zip(step.work.sequences, step.sizes, strict=True)))
        running = []
        for seq in step.work.decodes:
            if seq.status is Status.FINISHED:  # its last token is now fed
                self.scheduler.finish(seq)
                collector.finish(seq)
            else:
                running.append(seq)
        for job in step.work.prefills:
            running += self._fork(job, collector)
        if step.draws:
            # a sample that finished in the step before was drawn for too (launched ahead): dropped
            live = {id(seq) for seq in running}
            kept = [(seq, int(t), float(lp)) for (_, seq), t, lp in zip(step.draws, *step.drawn.tolist(), strict=True)
                    if id(seq) in live]
            check_drawn([lp for _, _, lp in kept], len(step.draws))
            for seq, token, logp in kept:
                seq.tokens.append(token)
                seq.logprobs.append(logp)
                if token in sampling.stop_token_ids:
                    seq.status, seq.finish_reason = Status.FINISHED, "stop"
                elif seq.num_response >= sampling.max_new_tokens:
                    seq.status, seq.finish_reason = Status.FINISHED, "length"
        return running

    def _fork(self, job: PromptJob, collector: RolloutCollector) -> list[Sequence]:
        """The prefilled prompt's guidance recorded (once per group), then its samples forked."""
        if job.records_prompt:
            collector.record_prompt(job.prompt)
        else:
            collector.drop_rows(job.prompt)
        return self.scheduler.fork(job)
