"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured on first use, with its
inputs in static buffers filled from the host each step (`StepInputs`)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .model import ModelRunner, Segment, map_rows

# Batch sizes that get their own decode CUDA graph (a batch runs in the smallest that holds it).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


class StepInputs:
    """The host side of a decode graph's inputs: token ids, positions, cache slots, block tables
    [B, max_blocks] and lengths, filled in place for each step (pinned on CUDA, for asynchronous
    copies). A row's block table is rewritten only from where it changed: a sequence that keeps
    its row between steps only appends a block every block_size tokens, and converting whole
    Python lists every step cost more host time than the step's GPU work at large batches.

    Contract: a segment's `block_table` list only grows in place while the same sequence decodes
    (the engine's tables do: blocks are appended, never replaced); a new list object is a new
    sequence and rewrites its row.
    """

    def __init__(self, batch_size: int, max_blocks: int, scratch_block: int, block_size: int, pin: bool):
        # one buffer, so that a step's inputs reach the GPU in one copy (five took up to 0.19 ms
        # of host time a step: bench/results/decode_pass7_2026-12-01_h200.log)
        int32s = batch_size * (max_blocks + 1)
        self.buffer = torch.zeros(3 * batch_size + (int32s + 1) // 2, dtype=torch.long, pin_memory=pin)
        self.tensors = self.views(self.buffer, batch_size, max_blocks)
        self.arrays = {name: t.numpy() for name, t in self.tensors.items()}
        self.arrays["tables"].fill(scratch_block)
        self.batch_size, self.max_blocks, self.scratch, self.block_size = (batch_size, max_blocks, scratch_block,
                                                                           block_size)
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * batch_size  # (table written, its length)

    @staticmethod
    def views(buffer: torch.Tensor, batch_size: int, max_blocks: int) -> dict[str, torch.Tensor]:
        """The inputs as views of one int64 buffer (host or device): ids, pos, slots int64 [B],
        then tables int32 [B, max_blocks] and lens int32 [B]."""
        b = batch_size
        int32s = buffer[3 * b:].view(torch.int32)
        return {"ids": buffer[:b], "pos": buffer[b:2 * b], "slots": buffer[2 * b:3 * b],
                "tables": int32s[:b * max_blocks].view(b, max_blocks),
                "lens": int32s[b * max_blocks:b * (max_blocks + 1)]}

    def fill(self, segments: list[Segment]) -> None:
        """Write one decode step of these sequences (padding rows: token 0 at position 0 of the
        scratch block)."""
        n, bs, tables = len(segments), self.block_size, self.arrays["tables"]
        if n > self.batch_size or any(len(s.token_ids) != 1 or len(s.block_table) > self.max_blocks for s in segments):
            raise ValueError(f"a decode graph for {self.batch_size} sequences of up to {self.max_blocks} blocks "
                             "cannot run this batch")
        for i in range(self.batch_size):
            table = segments[i].block_table if i < n else None
            old, written = self._rows[i]
            if table is not None and table is old and len(table) >= written:
                tables[i, written:len(table)] = table[written:]
            else:
                tables[i, :written] = self.scratch
                if table is not None:
                    tables[i, :len(table)] = table
            self._rows[i] = (table, 0 if table is None else len(table))
        pos, ids = self.arrays["pos"], self.arrays["ids"]
        pos[:n] = [s.start for s in segments]
        pos[n:] = 0
        ids[:n] = [s.token_ids[0] for s in segments]
        ids[n:] = 0
        self.arrays["slots"][:] = tables[np.arange(self.batch_size), pos // bs].astype(np.int64) * bs + pos % bs
        self.arrays["lens"][:] = pos + 1


class DecodeGraph:
    """One decode step for a fixed batch size, captured as a CUDA graph.

    Token ids, positions, cache slots, block tables [B, max_blocks] and lengths live in static
    buffers that `run` fills before each replay (from `StepInputs`); the outputs (logits,
    captured site rows of `capture_layers`, routed experts) are the graph's static outputs,
    overwritten by the next replay. Warm-up and capture write K/V only into `scratch_block`, a
    cache block reserved for it, and so do the padding rows of a smaller batch. `pool`: a graph
    memory pool shared with the other batch sizes' graphs (they never replay at the same time).
    `keep`: as `forward`.
    """

    def __init__(self, runner: ModelRunner, batch_size: int, max_blocks: int, scratch_block: int,
                 capture_layers=frozenset(), pool=None, keep=None):
        dev = runner.w.device
        bs = runner.cache.block_size
        self.runner, self.batch_size, self.max_blocks, self.scratch = runner, batch_size, max_blocks, scratch_block
        self.inputs = StepInputs(batch_size, max_blocks, scratch_block, bs, pin=True)
        self.inputs.fill([])  # every row padding: the scratch block
        self.buffer = self.inputs.buffer.to(dev)
        for name, t in StepInputs.views(self.buffer, batch_size, max_blocks).items():  # what the graph reads
            setattr(self, name, t)
        self.decode_only, self.last = True, None
        self._copied = torch.cuda.Event()  # recorded once the last copies have read the host buffers
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile the Triton kernels and warm the allocator
            for _ in range(2):
                runner.forward_batch(self, capture_layers, keep=keep)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, self.captured, self.routed = runner.forward_batch(self, capture_layers, keep=keep)

    def run(self, segments: list[Segment], ids: torch.Tensor | None = None):
        """`ModelRunner.forward` of one decode step of these sequences (`ids` as there):
        (logits [n, V], captured rows, routed experts), views of the static outputs; fewer than
        batch_size sequences are padded with the scratch block."""
        n, cfg = len(segments), self.runner.model_cfg
        self._copied.synchronize()  # the previous step's copies have read the host buffers
        self.inputs.fill(segments)
        self.buffer.copy_(self.inputs.buffer, non_blocking=True)
        self._copied.record()
        if ids is not None:
            if ids.shape != (n,):
                raise ValueError(f"DecodeGraph.run: ids {tuple(ids.shape)} for {n} sequences")
            self.ids[:n].copy_(ids)
        self.graph.replay()
        captured = {(layer, site): map_rows(lambda t, r=n * cfg.rows_per_token(layer, site): t[:r], rows)
                    for (layer, site), rows in self.captured.items()}
        return self.logits[:n], captured, {layer: t[:n] for layer, t in self.routed.items()}


class DecodeGraphs:
    """The decode graphs of one engine, by batch-size bucket (up to `max_batch`), captured on
    first use with a shared memory pool; their padding rows write K/V into `scratch_block`, a
    cache block kept out of the scheduler's reach. Sequences hold at most `max_tokens` tokens."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_tokens: int, scratch_block: int,
                 capture_layers=frozenset(), keep=None):
        self.runner, self.max_batch, self.scratch = runner, max_batch, scratch_block
        self.max_blocks = math.ceil(max_tokens / runner.cache.block_size)
        self.capture_layers, self.keep = capture_layers, keep
        self.graphs: dict[int, DecodeGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def get(self, batch: int) -> DecodeGraph | None:
        """The graph for a decode step of `batch` sequences (the smallest bucket that holds it),
        or None when the batch is larger than max_batch."""
        if batch > self.max_batch:
            return None
        size = min(next(b for b in GRAPH_BUCKETS + (self.max_batch,) if b >= batch), self.max_batch)
        if size not in self.graphs:
            self.graphs[size] = DecodeGraph(self.runner, size, self.max_blocks, self.scratch, self.capture_layers,
                                            self.pool, keep=self.keep)
        return self.graphs[size]

    def capture_all(self) -> None:
        """Capture the graph of every bucket up to max_batch now (SGLang does so at start), so that
        no later decode step pays for a capture (seconds each at 48 layers)."""
        for batch in GRAPH_BUCKETS + (self.max_batch,):
            if batch <= self.max_batch:
                self.get(batch)
