"""GPU-only parts of the engine: a decode step replayed as a CUDA graph against eager decode.

Needs CUDA (bench/gpu_rollout.sh runs it); CI has no GPU.
"""

import pytest
import torch

from megatron_trace.model_config import PRESETS
from sglang_rollout.engine import EngineConfig, TraceEngine
from sglang_rollout.engine.model import DecodeGraph, Segment

from ..megatron_trace import scenarios as sc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("precision", ["bf16", "fp4"])
def test_cuda_graph_decode_equals_eager_decode(precision):
    cfg = PRESETS["tiny"]
    engine = TraceEngine(cfg, EngineConfig(precision=precision, block_size=16, num_blocks=64, device="cuda"))
    engine.update_weights(sc.random_full_state_dict(cfg), 0)
    tables = [engine.cache.allocator.allocate(2) for _ in range(3)]
    (scratch,) = engine.cache.allocator.allocate(1)
    g = torch.Generator().manual_seed(0)
    for t in tables:  # a prompt of 20 tokens in each sequence's cache
        engine.runner.forward([Segment(torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist(), 0, t)])
    graph = DecodeGraph(engine.runner, batch_size=4, max_blocks=2, scratch_block=scratch)  # padded batch
    for step in range(3):
        segs = [Segment([int(torch.randint(0, cfg.vocab_size, (), generator=g))], 20 + step, t) for t in tables]
        logits_graph, routed_graph = graph.run(segs)
        logits_graph = logits_graph.clone()
        routed_graph = {k: v.clone() for k, v in routed_graph.items()}
        logits, _, routed = engine.runner.forward(segs)  # rewrites the same K/V slots
        assert torch.equal(logits_graph, logits)
        assert all(torch.equal(routed_graph[k], routed[k]) for k in routed)
