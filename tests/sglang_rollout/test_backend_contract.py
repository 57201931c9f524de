"""The contract of `megatron_trace.rollout.RolloutBackend`: what the RL loop relies on, asked of
every backend through the protocol alone (built as `trace-rl` builds it, by dotted path).

A new backend joins by adding an entry to BACKENDS: (dotted path, EngineConfig options, whether
one engine per configuration serves the whole module: SGLang's take seconds to start, so they
are kept, each test loading its weights as a newer version).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_trace.backend import make_backend
from megatron_trace.model_config import FP4_WEIGHT_SUFFIXES, PRESETS
from megatron_trace.modes import EnginePrecision
from megatron_trace.rollout import GroupRequest, SamplingParams
from megatron_trace.weight_buckets import Buckets, Piece, Source, state_dict_buckets
from tests.support import scenarios as sc
from trace_kernels.fp4 import quantize

CFG = PRESETS["tiny"]
BACKENDS = {
    "builtin": ("sglang_rollout.engine:TraceEngine", {"device": "cpu", "block_size": 4, "num_blocks": 128}, False),
    "sglang": ("sglang_rollout.sglang:SGLangEngine", {"device": "cpu", "block_size": 4, "num_blocks": 256}, True),
}
REQUESTS = [GroupRequest("g0", (1, 2, 3, 4, 5), n=3), GroupRequest("g1", (7, 8, 9, 10, 11, 12, 13), n=2),
            GroupRequest("g2", (42,), n=2)]


@pytest.fixture(scope="module")
def sd():
    return sc.random_full_state_dict(CFG, seed=21)


@pytest.fixture(scope="module")
def kept():
    """Engines of the backends that are kept for the module, by configuration; shut down after."""
    engines = {}
    yield engines
    for engine in engines.values():
        getattr(engine, "shutdown", lambda: None)()


@pytest.fixture(params=list(BACKENDS))
def new_backend(request, kept):
    """build(precision, guide, fresh=False) -> a backend: a new one, or the module's engine of
    that configuration for a kept backend (fresh=True: a new one in any case)."""
    path, options, keep = BACKENDS[request.param]
    made = []

    def build(precision="fp4", guide="none", coding="dense", fresh=False):
        key = (request.param, precision, guide, coding)
        if keep and not fresh and key in kept:
            return kept[key]
        backend = make_backend(path, CFG, precision=precision, guide=guide, coding=coding, **options)
        if keep and not fresh:
            kept[key] = backend
        else:
            made.append(backend)
        return backend
    yield build
    for backend in made:
        getattr(backend, "shutdown", lambda: None)()


def loaded(new_backend, sd, **kw):
    """A backend holding `sd` as its newest weight version."""
    backend = new_backend(**kw)
    backend.update_weights(sd, backend.weight_version + 1)
    return backend


def key(sample):
    return sample.sample_id, tuple(sample.tokens), tuple(sample.logprobs.tolist()), sample.finish_reason


def test_a_backend_has_no_weights_until_given_some(new_backend):
    backend = new_backend(precision="bf16", fresh=True)
    assert backend.precision is EnginePrecision.BF16 and backend.weight_version == -1
    with pytest.raises(RuntimeError, match="no weights"):
        backend.generate(REQUESTS, SamplingParams())


def test_stale_or_misfit_weights_are_refused_and_change_nothing(new_backend, sd):
    backend = loaded(new_backend, sd)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    version = backend.weight_version
    before = [key(s) for s in backend.generate(REQUESTS, greedy).samples]
    other = sc.random_full_state_dict(CFG, seed=22)
    with pytest.raises(ValueError, match="not newer"):
        backend.update_weights(other, version)
    misfit = dict(other, **{"output_layer.weight": other["output_layer.weight"][:, :32]})
    with pytest.raises(ValueError, match="output_layer.weight"):
        backend.update_weights(misfit, version + 1)
    assert backend.weight_version == version and [key(s) for s in backend.generate(REQUESTS, greedy).samples] == before
    backend.update_weights(other, version + 3)
    out = backend.generate(REQUESTS, greedy)
    assert {s.weight_version for s in out.samples} == {version + 3} and [key(s) for s in out.samples] != before


def test_fp4_weights_may_arrive_packed(new_backend, sd):
    """A packed FP4 update (the trainer's weight sync) equals BF16 quantized on receipt."""
    packed = {k: quantize(v, "nvfp4") if k.endswith(FP4_WEIGHT_SUFFIXES) else v for k, v in sd.items()}
    params = SamplingParams(max_new_tokens=5, seed=4)
    a = [key(s) for s in loaded(new_backend, sd).generate(REQUESTS, params).samples]
    b = new_backend()
    b.update_weights(packed, b.weight_version + 1)
    assert a == [key(s) for s in b.generate(REQUESTS, params).samples]


def sliced_buckets(sd: dict, fp4: bool, max_bytes: int = 4096) -> Buckets:
    """`sd` as the sharded weight sync sends it: each weight in two slices (the output projection
    and fc2 by columns, the rest by rows, as two tensor-parallel ranks hold them), FP4 sites
    packed on the way with the global scale of the whole tensor, cut into small buckets."""
    sources = []
    for name, t in sd.items():
        dim = 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0
        half = t.shape[dim] // 2
        packed = fp4 and name.endswith(FP4_WEIGHT_SUFFIXES)
        kind = "nvfp4" if packed else str(t.dtype).removeprefix("torch.")
        for start in (0, half):
            part = t.narrow(dim, start, half)
            sources.append(Source(Piece(name, kind, dim, start, tuple(part.shape), tuple(t.shape)), part,
                                  t.abs().amax().float() if packed else None))
    return Buckets(sources, max_bytes)


@pytest.mark.parametrize("precision", ["bf16", "fp4"])
def test_weights_may_arrive_as_buckets_of_slices(new_backend, sd, precision):
    """The weight sync's path (update_weights_from_buckets) gives the samples of a whole state dict."""
    params = SamplingParams(max_new_tokens=5, seed=4)
    a = [key(s) for s in loaded(new_backend, sd, precision=precision).generate(REQUESTS, params).samples]
    b = new_backend(precision=precision)
    b.update_weights_from_buckets(sliced_buckets(sd, precision == "fp4"), b.weight_version + 1)
    assert a == [key(s) for s in b.generate(REQUESTS, params).samples]


def test_a_bad_or_incomplete_bucketed_update_is_refused_by_name(new_backend, sd):
    """A bucket that does not fit is refused whole, naming the weight, before any of it is
    written: the old weights stay. An update that ends incomplete is refused too; then a
    backend either generates as before (it checked everything first) or, having written part
    of it, refuses to generate: never from a mix. A complete update recovers either way."""
    backend = loaded(new_backend, sd)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    version = backend.weight_version
    before = [key(s) for s in backend.generate(REQUESTS, greedy).samples]
    other = sc.random_full_state_dict(CFG, seed=23)
    unknown = {"decoder.layers.0.mlp.bogus.weight": torch.zeros(4, 16)} | other
    with pytest.raises(ValueError, match="unknown tensor 'decoder.layers.0.mlp.bogus.weight'"):
        backend.update_weights_from_buckets(state_dict_buckets(unknown, 1 << 16, fp4=True), version + 1)
    misfit = {"output_layer.weight": other["output_layer.weight"][:, :32]} | {k: v for k, v in other.items()
                                                                             if k != "output_layer.weight"}
    with pytest.raises(ValueError, match=r"output_layer.weight has shape \(256, 32\)"):
        backend.update_weights_from_buckets(state_dict_buckets(misfit, 1 << 16, fp4=True), version + 1)
    assert backend.weight_version == version and [key(s) for s in backend.generate(REQUESTS, greedy).samples] == before
    partial = {k: v for k, v in other.items() if k != "decoder.layers.1.mlp.router.weight"}
    with pytest.raises(ValueError, match=r"incomplete: 1 weights .* \['decoder.layers.1.mlp.router.weight'\]"):
        backend.update_weights_from_buckets(state_dict_buckets(partial, 1 << 16, fp4=True), version + 1)
    assert backend.weight_version == version
    try:
        assert [key(s) for s in backend.generate(REQUESTS, greedy).samples] == before
    except RuntimeError as e:
        assert "mix of versions" in str(e)
    backend.update_weights_from_buckets(state_dict_buckets(other, 1 << 16, fp4=True), version + 2)
    assert {s.weight_version for s in backend.generate(REQUESTS, greedy).samples} == {version + 2}


@pytest.mark.parametrize("precision", ["bf16", "fp4"])
def test_samples_come_in_request_order_with_their_logprobs(new_backend, sd, precision):
    backend = loaded(new_backend, sd, precision=precision)
    out = backend.generate(REQUESTS, SamplingParams(max_new_tokens=6, seed=1))
    assert [s.sample_id for s in out.samples] == [f"{r.group_id}/{i}" for r in REQUESTS for i in range(r.n)]
    for s, req in zip(out.samples, [r for r in REQUESTS for _ in range(r.n)], strict=True):
        assert s.group_id == req.group_id and s.prompt_len == len(req.prompt_ids) and s.error is None
        assert 1 <= len(s.tokens) <= 6 and all(0 <= t < CFG.vocab_size for t in s.tokens)
        assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == (len(s.tokens),)
        assert bool((s.logprobs <= 0).all()) and s.finish_reason == "length"
        assert s.weight_version == backend.weight_version


def test_generation_stops_after_a_stop_token(new_backend, sd):
    stops = tuple(range(0, CFG.vocab_size, 17))
    out = loaded(new_backend, sd).generate(REQUESTS, SamplingParams(max_new_tokens=12, seed=2, stop_token_ids=stops))
    reasons = set()
    for s in out.samples:
        assert not any(t in stops for t in s.tokens[:-1])
        assert s.finish_reason == ("stop" if s.tokens[-1] in stops else "length")
        assert s.finish_reason == "stop" or len(s.tokens) == 12
        reasons.add(s.finish_reason)
    assert reasons == {"stop", "length"}  # both ends were reached (with this seed)


def test_a_seed_fixes_the_samples_whatever_else_is_in_the_batch(new_backend, sd):
    backend = loaded(new_backend, sd)
    params = SamplingParams(max_new_tokens=6, seed=7, temperature=1.0, top_p=0.9)
    together = {s.sample_id: key(s) for s in backend.generate(REQUESTS, params).samples}
    for req in REQUESTS:  # alone, and behind the others
        alone = backend.generate([req], params).samples
        behind = backend.generate([r for r in REQUESTS if r is not req] + [req], params).samples
        assert [key(s) for s in alone] == [together[s.sample_id] for s in alone]
        assert {s.sample_id: key(s) for s in behind} == together
    other = backend.generate(REQUESTS, SamplingParams(max_new_tokens=6, seed=8, temperature=1.0, top_p=0.9))
    assert {s.sample_id: key(s) for s in other.samples} != together


def test_a_bad_request_fails_alone(new_backend, sd):
    backend = loaded(new_backend, sd)
    params = SamplingParams(max_new_tokens=5, seed=3)
    good = [key(s) for s in backend.generate(REQUESTS, params).samples]
    bad = [GroupRequest("oov", (1, CFG.vocab_size + 5), n=2), GroupRequest("empty", (), n=1),
           GroupRequest("long", (1,) * (CFG.max_position_embeddings + 1), n=1)]
    out = backend.generate(REQUESTS[:1] + bad + REQUESTS[1:], params)
    failed = [s for s in out.samples if s.group_id in ("oov", "empty", "long")]
    assert len(failed) == 4 and all(s.finish_reason == "error" and s.error and not s.tokens for s in failed)
    assert [key(s) for s in out.samples if s.error is None] == good


def test_finished_groups_are_handed_over_once_each(new_backend, sd):
    backend = loaded(new_backend, sd, guide="all")
    streamed = []
    reqs = REQUESTS + [GroupRequest("oov", (CFG.vocab_size,), n=1)]
    out = backend.generate(reqs, SamplingParams(max_new_tokens=6, seed=5), on_group=streamed.append)
    assert sorted(part.samples[0].group_id for part in streamed) == sorted(r.group_id for r in reqs)
    by_id = {s.sample_id: key(s) for s in out.samples}
    for part in streamed:
        ids = [s.sample_id for s in part.samples]
        assert (len({s.group_id for s in part.samples}) == 1
                and [by_id[i] for i in ids] == [key(s) for s in part.samples])
        if part.samples[0].error is None:
            assert (sorted(part.guidance.samples) == sorted(ids)
                    and list(part.guidance.groups) == [part.samples[0].group_id])



def test_a_group_that_finishes_first_is_handed_over_first(new_backend, sd):
    """Streaming, not a loop at the end: a group listed second but stopped after one token
    reaches on_group before the group listed ahead of it, which runs to max_new_tokens."""
    backend = loaded(new_backend, sd)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    slow = GroupRequest("slow", (7, 8, 9, 10, 11, 12, 13), n=2)
    drawn = set(backend.generate([slow], greedy).samples[0].tokens)
    for start in range(1, 40):  # a prompt whose first greedy token the slow group never draws
        fast = GroupRequest("fast", (start, start + 1), n=2)
        stop = backend.generate([fast], greedy).samples[0].tokens[0]
        if stop not in drawn:
            break
    else:
        pytest.fail("no prompt found whose first token the slow group never draws")
    streamed = []
    out = backend.generate([slow, fast], dataclasses.replace(greedy, stop_token_ids=(stop,)),
                           on_group=lambda part: streamed.append(part.samples[0].group_id))
    assert {s.group_id: len(s.tokens) for s in out.samples} == {"slow": 12, "fast": 1}
    assert streamed == ["fast", "slow"] and [s.group_id for s in out.samples] == ["slow"] * 2 + ["fast"] * 2


def test_repeated_group_ids_are_refused(new_backend, sd):
    backend = loaded(new_backend, sd)
    with pytest.raises(ValueError, match="repeat.*'g0'"):
        backend.generate([REQUESTS[0], REQUESTS[1], REQUESTS[0]], SamplingParams(max_new_tokens=2))

@pytest.mark.parametrize("precision, guide", [("bf16", "none"), ("fp4", "all"), ("fp4", "deep:1")])
def test_guidance_covers_every_token_the_trainer_will_see(new_backend, sd, precision, guide):
    backend = loaded(new_backend, sd, precision=precision, guide=guide)
    out = backend.generate(REQUESTS, SamplingParams(max_new_tokens=5))
    version = backend.weight_version
    guided = {"none": [], "all": [0, 1], "deep:1": [1]}[guide]
    sites = sorted(("qkv", "proj", "fc1", "fc2", "k", "v"))
    for s in out.samples:
        sample, group = out.guidance.samples[s.sample_id], out.guidance.groups[s.group_id]
        assert (sample.response_len, sample.weight_version, group.prompt_len) == (len(s.tokens), version, s.prompt_len)
        for layer in range(CFG.num_layers):  # routed experts: every MoE layer, every token
            assert sample.routed_experts[layer].shape == (len(s.tokens), CFG.top_k)
            assert group.routed_experts[layer].shape == (s.prompt_len, CFG.top_k)
        assert sorted(sample.records) == [(layer, site) for layer in guided for site in sites]
        assert sorted(group.records) == [(layer, site) for layer in guided for site in sites]
        for (_, site), record in sample.records.items():
            per_token = {"k": CFG.num_key_value_heads, "v": CFG.num_key_value_heads, "fc2": CFG.top_k}.get(site, 1)
            assert record.header.rows == len(s.tokens) * per_token and record.header.weight_version == version
