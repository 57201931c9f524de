"""GPU-only parts of the engine: a decode step replayed as a CUDA graph against eager decode.

Needs CUDA (bench/gpu_rollout.sh runs it); CI has no GPU.
"""

import dataclasses

import pytest
import torch

from megatron_trace.model_config import PRESETS
from sglang_rollout.engine import EngineConfig, TraceEngine
from sglang_rollout.engine.cuda_graphs import DecodeGraph
from sglang_rollout.engine.model import Segment
from tests.support import scenarios as sc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# head dim 128 with 8 query heads per KV head (Qwen3's attention shape) and 128-wide expert inputs:
# FP4 decode runs the CUDA C++ kernels (trace_kernels.fp4.cuda_decode) on Hopper; "tiny" (head dim
# 16, width 64) runs the Triton ones
QWEN3_HEADS = dataclasses.replace(PRESETS["tiny"], hidden_size=128, moe_intermediate_size=128, num_attention_heads=8,
                                  num_key_value_heads=1, head_dim=128)


@pytest.mark.parametrize("precision, cfg", [("bf16", PRESETS["tiny"]), ("fp4", PRESETS["tiny"]), ("fp4", QWEN3_HEADS)])
def test_cuda_graph_decode_equals_eager_decode(precision, cfg, monkeypatch):
    from trace_kernels.fp4 import cuda_decode

    calls = {"split_attention": 0, "grouped_linear": 0}
    for name in calls:
        launch = getattr(cuda_decode, name)
        monkeypatch.setattr(cuda_decode, name, lambda *a, name=name, launch=launch, **k: calls.update(
            {name: calls[name] + 1}) or launch(*a, **k))
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
        logits_graph, _, routed_graph = graph.run(segs)
        logits_graph = logits_graph.clone()
        routed_graph = {k: v.clone() for k, v in routed_graph.items()}
        logits, _, routed = engine.runner.forward(segs)  # rewrites the same K/V slots
        assert torch.equal(logits_graph, logits)
        assert all(torch.equal(routed_graph[k], routed[k]) for k in routed)
    # the eager steps (and the graph's capture) ran the CUDA kernels exactly where they apply
    cuda = precision == "fp4" and cfg is QWEN3_HEADS and torch.cuda.get_device_capability() >= (9, 0)
    assert all(bool(n) == cuda for n in calls.values()), calls


@pytest.mark.parametrize("precision, guide, coding", [("bf16", "none", "dense"), ("fp4", "all", "dense"),
                                                      ("fp4", "all", "sparse")])
def test_engine_generates_the_same_with_cuda_graphs(precision, guide, coding):
    """Decode steps replayed from per-bucket graphs (batches padded to 1, 2, 4, 8 as groups finish)
    give the eager engine's tokens, log-probabilities, routed experts and guidance rows (sparse:
    the parts computed inside the graph)."""
    from megatron_trace.guidance.rows import RowGuidance
    from megatron_trace.rollout import GroupRequest, SamplingParams

    cfg = PRESETS["tiny"]
    sd = sc.random_full_state_dict(cfg)
    requests = [GroupRequest("a", (1, 2, 3, 4, 5), n=3), GroupRequest("b", tuple(range(7, 40)), n=2),
                GroupRequest("c", (9, 9, 9), n=2)]
    outs = {}
    for graphs in (0, 256, 8):
        engine = TraceEngine(cfg, EngineConfig(precision=precision, block_size=16, num_blocks=64, device="cuda",
                                               guide=guide, coding=coding, cuda_graph_max_batch=graphs))
        engine.update_weights(sd, 0)
        if graphs == 8:  # every bucket captured before the first step, as SGLang does at start
            engine.capture_graphs()
            assert sorted(engine.graphs.graphs) == [1, 2, 4, 8]
        outs[graphs] = engine.generate(requests, SamplingParams(max_new_tokens=12, temperature=0))
        assert bool(engine.graphs and engine.graphs.graphs) == bool(graphs)
    assert [s.tokens for s in outs[8].samples] == [s.tokens for s in outs[256].samples]
    for eager, graph in zip(outs[0].samples, outs[256].samples, strict=True):
        assert eager.tokens == graph.tokens
        torch.testing.assert_close(eager.logprobs, graph.logprobs, atol=1e-3, rtol=0)
    for sid in (s.sample_id for s in outs[0].samples):
        a, b = outs[0].guidance.samples[sid], outs[256].guidance.samples[sid]
        assert all(torch.equal(a.routed_experts[k], b.routed_experts[k]) for k in a.routed_experts)
        assert a.records.keys() == b.records.keys()
        for key, rec in a.records.items():  # cuBLAS may pick another kernel for a padded batch: nearly all bits
            if coding == "sparse":  # position streams of other lengths: compare the decoded rows
                ra, rb = RowGuidance.from_record(rec), RowGuidance.from_record(b.records[key])
                pairs = {"g": (ra.g, rb.g), "bits": (ra.bits, rb.bits), "bit_known": (ra.bit_known, rb.bit_known)}
            else:
                pairs = {name: (t, b.records[key].payload[name]) for name, t in rec.payload.items()}
            for name, (x, y) in pairs.items():
                assert (x == y).float().mean() > 0.99, (sid, key, name)



@pytest.mark.parametrize("precision, guide", [("bf16", "none"), ("fp4", "all")])
def test_overlapped_graph_steps_give_the_serial_outputs(precision, guide):
    """On the GPU, where overlap lets the host run ahead of the device: decode steps launched
    before the last one's results are taken in give the serial engine's tokens, log-probs and
    guidance bytes bit for bit (the same kernels on the same batches), stops at many steps."""
    from megatron_trace.rollout import GroupRequest, SamplingParams

    cfg = PRESETS["tiny"]
    sd = sc.random_full_state_dict(cfg)
    requests = [GroupRequest("a", (1, 2, 3, 4, 5), n=3), GroupRequest("b", tuple(range(7, 40)), n=5)]
    params = SamplingParams(max_new_tokens=24, seed=3, temperature=1.0, top_p=0.9,
                            stop_token_ids=tuple(range(5, 256, 9)))
    outs = {}
    for overlap in (False, True):
        engine = TraceEngine(cfg, EngineConfig(precision=precision, block_size=16, num_blocks=64, device="cuda",
                                               guide=guide, overlap=overlap))
        engine.update_weights(sd, 0)
        outs[overlap] = engine.generate(requests, params)
        assert engine.cache.allocator.num_free == 64  # every block back (the graphs' scratch block is on top)
    assert "stop" in {s.finish_reason for s in outs[False].samples}
    for a, b in zip(outs[False].samples, outs[True].samples, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert torch.equal(a.logprobs, b.logprobs)
    assert outs[False].guidance.to_bytes() == outs[True].guidance.to_bytes()


def test_num_blocks_is_what_sequences_get_with_cuda_graphs():
    """With CUDA graphs the scratch block comes on top of num_blocks: an engine sized to exactly
    one sequence's blocks (as trace-ptq-fp4's calibration sizes it) scores and calibrates it, and
    its log-probs and amaxes are those of an engine without graphs."""
    cfg = PRESETS["tiny"]
    tokens = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    weights = sc.random_full_state_dict(cfg)
    results = []
    for graphs in (8, 0):
        engine = TraceEngine(cfg, EngineConfig(precision="fp4", block_size=16, num_blocks=4, device="cuda",
                                               max_batch_tokens=64, cuda_graph_max_batch=graphs))
        engine.update_weights(weights, 0)
        assert (engine.graphs is not None) == bool(graphs)
        results.append((engine.score(tokens), engine.activation_amax([tokens])))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
