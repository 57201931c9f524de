"""The built-in engine on the CPU: decode against full-sequence forwards (its own, transformers',
Megatron's), paged prompt sharing, seeds, stops, weight updates, guidance and bad input."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from megatron_trace.guidance import GuidanceBatch, capture
from megatron_trace.model_config import PRESETS
from megatron_trace.rollout import GroupRequest, SamplingParams
from sglang_rollout.engine import EngineConfig, TraceEngine
from tests.support import scenarios as sc
from trace_kernels.fp4 import quantize

CFG = PRESETS["tiny"]
REQUESTS = [GroupRequest("g0", (1, 2, 3, 4, 5), n=3), GroupRequest("g1", (7, 8, 9, 10, 11, 12, 13, 14, 15), n=2)]


@pytest.fixture(scope="module")
def sd():
    return sc.random_full_state_dict(CFG)


def engine(sd, precision="bf16", version=0, **kw):
    share = kw.pop("share_prompts", True)
    e = TraceEngine(CFG, EngineConfig(precision=precision, **{"block_size": 4, "num_blocks": 128, **kw}),
                    share_prompts=share)
    e.update_weights(sd, version)
    return e


@pytest.mark.parametrize("precision", ["bf16", "fp4"])
def test_decoded_logprobs_match_a_full_sequence_forward(sd, precision):
    """Incremental decode over the paged cache = one prefill of the whole sequence: the same
    arithmetic up to reduction order (and, in fp4, the rounding flips that order causes)."""
    e = engine(sd, precision)
    out = e.generate(REQUESTS, SamplingParams(max_new_tokens=8, seed=3))
    gaps = []
    for s in out.samples:
        full = e.score(list(REQUESTS[int(s.group_id[1])].prompt_ids) + s.tokens)[s.prompt_len - 1:]
        gaps.append((full - s.logprobs).abs().max())
        assert s.finish_reason == "length" and len(s.tokens) == 8 and s.weight_version == 0
    assert max(gaps) < 1e-4, gaps  # on the CPU the two are in fact bit-identical


def test_shared_prompt_blocks_give_the_same_samples_as_unshared(sd):
    params = SamplingParams(max_new_tokens=7, seed=11, temperature=0.8, top_p=0.9)
    shared = engine(sd, "fp4").generate(REQUESTS, params)
    alone = engine(sd, "fp4", share_prompts=False).generate(REQUESTS, params)
    for a, b in zip(shared.samples, alone.samples, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
    e = engine(sd, "fp4")
    e.generate(REQUESTS, params)
    assert e.cache.allocator.num_free == 128  # every block returned


def test_finished_groups_stream_while_others_generate(sd):
    """on_group gets each group once, as soon as it completes: when the first group arrives the
    other still holds KV blocks (it is still generating)."""
    e = engine(sd, "fp4", guide="all")
    streamed, held = [], []

    def on_group(out):
        streamed.append(out)
        held.append(128 - e.cache.allocator.num_free)
    reqs = REQUESTS + [GroupRequest("bad", (1, 999), n=2)]  # refused at admission: streamed last
    out = e.generate(reqs, SamplingParams(max_new_tokens=6, seed=2), on_group=on_group)
    assert sorted(o.samples[0].group_id for o in streamed) == ["bad", "g0", "g1"]
    assert held[0] > 0 and held[-1] == 0
    assert streamed[-1].samples[0].group_id == "bad" and streamed[-1].samples[0].error
    by_group = {o.samples[0].group_id: o for o in streamed}
    for r in REQUESTS:
        part = by_group[r.group_id]
        whole = [s for s in out.samples if s.group_id == r.group_id]
        assert [s.tokens for s in part.samples] == [s.tokens for s in whole]
        assert set(part.guidance.samples) == {s.sample_id for s in whole} and set(part.guidance.groups) == {r.group_id}
        # the streamed guidance is the batch's own records
        for sid, g in part.guidance.samples.items():
            assert g is out.guidance.samples[sid]


def test_seeds_reproduce_and_differ(sd):
    e = engine(sd, "fp4")
    p = SamplingParams(max_new_tokens=6, seed=5, top_k=20)
    a, b = e.generate(REQUESTS, p), e.generate(REQUESTS[::-1], p)
    c = e.generate(REQUESTS, SamplingParams(max_new_tokens=6, seed=6, top_k=20))
    by_id = {s.sample_id: s.tokens for s in b.samples}
    assert all(s.tokens == by_id[s.sample_id] for s in a.samples[:3])  # g0's samples, whatever the order
    assert [s.tokens for s in a.samples] != [s.tokens for s in c.samples]
    assert len({tuple(s.tokens) for s in a.samples[:3]}) > 1  # samples of a group differ


def _pooled_chi2(tokens: list[int], logprobs: list[float]) -> tuple[float, int]:
    """Pearson's chi-square of drawn tokens against their probabilities exp(logprob) (the
    engine's own, float64 here), cells expected below 5 pooled with the tokens never drawn."""
    n, counts, prob = len(tokens), collections.Counter(tokens), dict(zip(tokens, logprobs, strict=True))
    chi2, cells, pooled_obs, pooled_exp = 0.0, 0, 0, n * (1 - sum(math.exp(lp) for lp in prob.values()))
    for t, lp in prob.items():
        want = n * math.exp(lp)
        if want >= 5:
            chi2, cells = chi2 + (counts[t] - want) ** 2 / want, cells + 1
        else:
            pooled_obs, pooled_exp = pooled_obs + counts[t], pooled_exp + want
    return chi2 + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells


def test_every_decode_step_draws_from_the_engines_own_distribution(sd):
    # Many samples of one prompt: the second and third tokens, among the samples that share the
    # commonest prefix, must follow that prefix's distribution. A random stream reused from one
    # step to the next (the same noise at two positions) skews them; frequencies checked alone
    # at the first position would not see it.
    e = engine(sd, num_blocks=4096, max_batch_tokens=4096)
    out = e.generate([GroupRequest("g", (1, 2, 3, 4, 5), n=3000)], SamplingParams(temperature=0.2, max_new_tokens=3,
                                                                                   seed=7))
    for pos in range(3):
        prefix = collections.Counter(tuple(s.tokens[:pos]) for s in out.samples).most_common(1)[0][0]
        rows = [s for s in out.samples if tuple(s.tokens[:pos]) == prefix]
        chi2, cells = _pooled_chi2([s.tokens[pos] for s in rows], [float(s.logprobs[pos]) for s in rows])
        assert len(rows) > 500 and cells >= 4, (pos, len(rows), cells)
        assert chi2 < cells + 6 * math.sqrt(2 * cells), (pos, chi2, cells)  # df = cells; p < 1e-6 to fail


def test_a_samples_positions_draw_independent_noise(sd):
    # With one random stream reused at two positions of a sample (the same Gumbel noise), nearly
    # flat logits would repeat the previous token far more often than the model says. Expected
    # repeats: the sum over samples of p(t[i] = t[i-1] | prefix), each scored by a full forward.
    e = engine(sd, num_blocks=4096, max_batch_tokens=4096)
    prompt = (1, 2, 3, 4, 5)
    out = e.generate([GroupRequest("g", prompt, n=1500)], SamplingParams(temperature=1.0, max_new_tokens=3, seed=9))
    for pos in (1, 2):
        repeat_p = {}
        for s in out.samples:
            prefix = tuple(s.tokens[:pos])
            if prefix not in repeat_p:  # p(next = last token of prefix | prompt + prefix)
                repeat_p[prefix] = math.exp(float(e.score([*prompt, *prefix, prefix[-1]])[-1]))
        want = sum(repeat_p[tuple(s.tokens[:pos])] for s in out.samples)
        sigma = math.sqrt(sum(p * (1 - p) for p in (repeat_p[tuple(s.tokens[:pos])] for s in out.samples)))
        seen = sum(s.tokens[pos] == s.tokens[pos - 1] for s in out.samples)
        assert abs(seen - want) < 6 * sigma + 1, (pos, seen, want, sigma)


def test_greedy_stop_tokens_and_lengths(sd):
    e = engine(sd, "bf16")
    greedy = e.generate(REQUESTS[:1], SamplingParams(max_new_tokens=5, temperature=0))
    tokens = greedy.samples[0].tokens
    assert all(s.tokens == tokens for s in greedy.samples)
    stop = e.generate(REQUESTS[:1], SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(tokens[2],)))
    first = tokens.index(tokens[2])
    assert stop.samples[0].tokens == tokens[:first + 1] and stop.samples[0].finish_reason == "stop"


def test_decode_steps_never_copy_a_sequences_tokens(sd, monkeypatch):
    """A step's host work must not grow with the sequences' lengths: slicing each sequence's
    tokens for its response length twice a step (which this once did) cost 2.3-5.3 ms a step at
    batch 64 and 8.7k tokens (bench/engine_host_step.py), about FP4's whole GPU step there.
    `Sequence.response` (a copy) is read once per sample, when it finishes."""
    from sglang_rollout.engine.sequence import Sequence

    reads = collections.Counter()
    slicing = Sequence.response.fget
    monkeypatch.setattr(Sequence, "response", property(lambda seq: reads.update([seq.seq_id]) or slicing(seq)))
    out = engine(sd, "bf16", overlap=True).generate(REQUESTS, SamplingParams(max_new_tokens=12))
    assert [len(s.tokens) for s in out.samples] == [12] * 5 and all(s.finish_reason == "length" for s in out.samples)
    assert max(reads.values()) <= 1 and len(reads) <= 5, reads


def test_guidance_covers_every_token_and_round_trips(sd):
    e = engine(sd, "fp4", guide="deep:1")
    out = e.generate(REQUESTS, SamplingParams(max_new_tokens=4, seed=2, stop_token_ids=tuple(range(0, 256, 3))))
    g = GuidanceBatch.from_bytes(out.guidance.to_bytes())
    for s in out.samples:
        sample, group = g.samples[s.sample_id], g.groups[s.group_id]
        assert sample.response_len == len(s.tokens) and group.prompt_len == s.prompt_len
        assert sorted(sample.records) == [(1, site) for site in sorted(("qkv", "k", "v", "proj", "fc1", "fc2"))]
        for layer in range(CFG.num_layers):  # routed experts for every token of every layer
            assert sample.routed_experts[layer].shape == (len(s.tokens), CFG.top_k)
            assert group.routed_experts[layer].shape == (s.prompt_len, CFG.top_k)
        assert sample.records[(1, "fc2")].header.rows == len(s.tokens) * CFG.top_k


@pytest.mark.parametrize("scale_coding", ["lsb", "near"])
def test_sparse_records_ship_the_dense_records_bits_at_their_positions(sd, scale_coding):
    # the sparse engine quantizes a step's rows once on the device and slices the parts per
    # sequence; the dense engine's records are the reference for what each sample's rows were
    sampling = SamplingParams(max_new_tokens=5, seed=7)
    dense = engine(sd, "fp4", guide="all").generate(REQUESTS, sampling)
    sparse = engine(sd, "fp4", guide="all", coding="sparse", scale_coding=scale_coding).generate(REQUESTS, sampling)
    assert sc.sparse_ships_dense_bits(dense, sparse, scale_coding) > 0


@pytest.mark.parametrize("scale_coding", ["lsb", "near"])
def test_sparse_prompt_records_are_guidance_capture_of_the_engines_own_rows(sd, scale_coding):
    # the engine makes its sparse parts inside the forward from the fused quantize kernel's
    # capture; the reference is guidance.capture of the rows an uncaptured forward of the prompt
    # computes (quantized again, near-boundary elements found from the rows alone)
    e = engine(sd, "fp4", guide="all", coding="sparse", scale_coding=scale_coding)
    out = e.generate(REQUESTS, SamplingParams(max_new_tokens=2, seed=7))
    for req in REQUESTS:
        _, rows, _ = e._forward_whole(list(req.prompt_ids), frozenset(range(CFG.num_layers)))
        got = out.guidance.groups[req.group_id].records
        assert got.keys() == rows.keys()
        for (layer, site), x in rows.items():
            want = capture(x, quantize(x, scale="row"), model_id=e.engine_cfg.model_id, layer=layer, site=site,
                           sample_id=req.group_id, weight_version=0, policy="all", coding="sparse",
                           tau=e.engine_cfg.tau, scale_coding=scale_coding)
            assert got[(layer, site)].header == want.header
            for k, t in want.payload.items():
                assert torch.equal(got[(layer, site)].payload[k], t), (layer, site, k)


def test_weight_updates_take_effect_and_stale_or_misfit_ones_are_refused(sd):
    e = engine(sd, "fp4")
    params = SamplingParams(max_new_tokens=4, temperature=0)
    before = e.generate(REQUESTS[:1], params).samples[0]
    other = sc.random_full_state_dict(CFG, seed=9)
    with pytest.raises(ValueError, match="not newer"):
        e.update_weights(other, 0)
    bad = dict(other)
    bad["output_layer.weight"] = bad["output_layer.weight"][:, :32]
    with pytest.raises(ValueError, match=r"output_layer.weight has shape \(256, 32\)"):
        e.update_weights(bad, 1)
    with pytest.raises(ValueError, match="missing"):
        e.update_weights({k: v for k, v in other.items() if "router" not in k}, 1)
    assert e.weight_version == 0 and e.generate(REQUESTS[:1], params).samples[0].tokens == before.tokens
    e.update_weights(other, 1)
    after = e.generate(REQUESTS[:1], params).samples[0]
    assert after.weight_version == 1 and not torch.equal(after.logprobs, before.logprobs)
    # the new weights are really the ones used: a fresh engine built on them agrees
    fresh = engine(other, "fp4", version=7).generate(REQUESTS[:1], params).samples[0]
    assert fresh.tokens == after.tokens and torch.equal(fresh.logprobs, after.logprobs)


def test_an_update_that_fails_part_way_leaves_the_engine_refusing_to_generate(sd):
    """Buckets are written in place as they arrive (an update costs a bucket of memory): once one
    is written, a later bad bucket or an interrupted stream leaves a mix of versions, which the
    engine refuses to generate from, keeping its old version number, until a complete one arrives."""
    from megatron_trace.weight_buckets import state_dict_buckets

    e = engine(sd, "fp4")
    params = SamplingParams(max_new_tokens=4, temperature=0)
    other = sc.random_full_state_dict(CFG, seed=9)
    bad = dict(other, **{"decoder.layers.1.mlp.router.weight": other["decoder.layers.1.mlp.router.weight"][:2]})
    with pytest.raises(ValueError, match=r"decoder.layers.1.mlp.router.weight has shape \(2, 64\)"):
        e.update_weights_from_buckets(state_dict_buckets(bad, 4096, fp4=True), 1)
    assert e.weight_version == 0
    with pytest.raises(RuntimeError, match="mix of versions: the update to weight version 1 failed part-way"):
        e.generate(REQUESTS[:1], params)

    def interrupted():
        yield from list(state_dict_buckets(other, 4096, fp4=True))[:3]
        raise ConnectionError("the trainer went away")
    with pytest.raises(ConnectionError):
        e.update_weights_from_buckets(interrupted(), 2)
    with pytest.raises(RuntimeError, match="version 2 failed part-way .the trainer went away"):
        e.generate(REQUESTS[:1], params)
    e.update_weights_from_buckets(state_dict_buckets(other, 4096, fp4=True), 3)
    fresh = engine(other, "fp4", version=7).generate(REQUESTS[:1], params).samples[0]
    after = e.generate(REQUESTS[:1], params).samples[0]
    assert after.weight_version == 3 and after.tokens == fresh.tokens and torch.equal(after.logprobs, fresh.logprobs)


def test_packed_fp4_weights_from_the_trainer_equal_bf16_quantized_on_receipt(sd):
    """Weight sync sends FP4 (codes + scales, ~3.5x fewer bytes); the engine stores them in place."""
    from sglang_rollout.engine.weights import FP4_SUFFIXES
    from trace_kernels.fp4 import quantize

    packed = {k: quantize(v) if k.endswith(FP4_SUFFIXES) else v for k, v in sd.items()}
    params = SamplingParams(max_new_tokens=5, seed=8)
    a = engine(sd, "fp4")
    storage = a.weights.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].codes.data_ptr()
    b = engine(sc.random_full_state_dict(CFG, seed=3), "fp4")
    b.update_weights(packed, 1)
    assert b.weights.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].codes.data_ptr() != storage
    before = b.weights.tensors["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"].codes.data_ptr()
    b.update_weights(packed, 2)  # in place: the same storage
    assert (b.weights.tensors["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"].codes.data_ptr()
            == before)
    for x, y in zip(a.generate(REQUESTS, params).samples, b.generate(REQUESTS, params).samples, strict=True):
        assert x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs) and y.weight_version == 2
    bf16_engine = engine(sd, "bf16")
    with pytest.raises(ValueError, match="arrived as FP4"):
        bf16_engine.update_weights(packed, 1)


def test_bad_requests_fail_alone_with_a_reason(sd):
    e = engine(sd, "bf16")
    reqs = [GroupRequest("ok", (1, 2, 3), n=2), GroupRequest("oov", (1, 999), n=1),
            GroupRequest("long", tuple(range(200)) * 3, n=1), GroupRequest("empty", (), n=1)]
    out = e.generate(reqs, SamplingParams(max_new_tokens=4))
    reasons = {s.group_id: s.error for s in out.samples}
    assert reasons["ok"] is None and all(s.finish_reason == "length" for s in out.samples[:2])
    assert "outside the vocabulary" in reasons["oov"] and "999" in reasons["oov"]
    assert "exceeds the context" in reasons["long"]
    assert reasons["empty"] == "empty prompt"
    # a small cache: requests queue for blocks instead of failing; one that can never fit fails alone
    small = TraceEngine(CFG, EngineConfig(precision="bf16", block_size=4, num_blocks=12, max_batch_tokens=8))
    small.update_weights(sd, 0)
    out = small.generate([GroupRequest("a", (1, 2, 3), n=2), GroupRequest("b", (4, 5, 6, 7, 8), n=2),
                          GroupRequest("huge", (1, 2, 3), n=9), GroupRequest("wide", tuple(range(9)), n=1)],
                         SamplingParams(max_new_tokens=6))
    reasons = {s.group_id: s.error for s in out.samples}
    assert reasons["a"] is None and reasons["b"] is None
    assert all(len(s.tokens) == 6 for s in out.samples if s.group_id in ("a", "b"))
    assert "need up to" in reasons["huge"]
    assert reasons["wide"] is None and len(out.samples[-1].tokens) == 6  # longer than the budget: chunked
    assert small.cache.allocator.num_free == 12 and small.scheduler.committed == 0
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="precision"):
        EngineConfig(precision="fp8")
    with pytest.raises(ValueError, match="guide needs precision='fp4'"):
        EngineConfig(precision="bf16", guide="all")


def run_trainer_logprobs(rank, *, cfg, sd, samples, prompts, guidance):
    """Megatron (issue 4's trainer) log-probs of each sample's response, per trainer precision."""
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import build_model, set_precision, token_logprobs
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(cfg, "bf16")
    load_full_state_dict(model, sd)
    seqs = [torch.tensor(list(prompts[s.group_id]) + s.tokens) for s in samples]
    ids, pos, psp = sc.packed_inputs(seqs)
    targets = torch.roll(ids, -1, 1)
    mb = MicroBatchGuidance.from_batch(guidance, [s.sample_id for s in samples]).to(sc.device())
    out = {}
    for mode in ("bf16", "fp4-rne", "fp4-guided"):
        set_precision(model, mode)
        with torch.no_grad():
            lp = token_logprobs(model, ids, pos, targets, packed_seq_params=psp,
                                guidance=mb if mode == "fp4-guided" else None).reshape(-1).cpu()
        parts, offset = [], 0
        for s, seq in zip(samples, seqs, strict=True):
            parts.append(lp[offset + s.prompt_len - 1: offset + len(seq) - 1])
            offset += len(seq)
        out[mode] = parts
    return out


def test_trainer_follows_the_engine_with_guidance(sd):
    """The chain of the project: engine FP4 decode -> guidance -> Megatron's trace-mode forward.
    Without guidance the trainer's FP4 log-probs drift from the engine's (rounding flips from
    other kernels and reduction orders); with guidance on every layer they agree far better."""
    from megatron_trace.megatron.spawn import spawn

    e = engine(sd, "fp4", guide="all")
    out = e.generate(REQUESTS, SamplingParams(max_new_tokens=12, seed=4))
    prompts = {r.group_id: r.prompt_ids for r in REQUESTS}
    got = spawn(run_trainer_logprobs, {}, cfg=CFG, sd=sd, samples=out.samples, prompts=prompts,
                guidance=out.guidance)[0]
    gap = {mode: max(float((t - s.logprobs).abs().max()) for t, s in zip(got[mode], out.samples, strict=True))
           for mode in got}
    assert gap["fp4-guided"] < gap["fp4-rne"] / 4, gap
    assert gap["fp4-guided"] < 1e-3, gap  # measured 5e-7: the same codes everywhere


@pytest.mark.parametrize("precision, guide", [("bf16", "none"), ("fp4", "all")])
def test_overlapped_steps_give_the_serial_engines_outputs(sd, precision, guide, monkeypatch):
    """Launching each decode step before the last one's results are taken in (config.overlap)
    changes when the host learns of a stop, not what runs: the same tokens, log-probs, finish
    reasons and guidance bytes. Stops land at many steps; g2's prompt is prefilled in chunks
    beside the decodes (those steps run serially)."""
    reqs = REQUESTS + [GroupRequest("g2", tuple(range(20, 50)), n=4)]
    params = SamplingParams(max_new_tokens=9, seed=5, temperature=1.0, stop_token_ids=tuple(range(3, 256, 7)))
    ahead = []
    launch = TraceEngine._launch
    monkeypatch.setattr(TraceEngine, "_launch", lambda self, *a, after=None, **k: ahead.append(after is not None)
                        or launch(self, *a, after=after, **k))
    outs = {}
    for overlap in (False, True):
        ahead.clear()
        e = engine(sd, precision, guide=guide, overlap=overlap, max_batch_tokens=32)
        outs[overlap] = e.generate(reqs, params)
        assert any(ahead) == overlap and not all(ahead)
        assert e.cache.allocator.num_free == 128  # every block returned
    serial, overlapped = outs[False], outs[True]
    reasons = {s.finish_reason for s in serial.samples}
    assert reasons == {"stop", "length"} and len({len(s.tokens) for s in serial.samples}) > 2
    for a, b in zip(serial.samples, overlapped.samples, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert torch.equal(a.logprobs, b.logprobs)
    assert serial.guidance.to_bytes() == overlapped.guidance.to_bytes()


@pytest.mark.parametrize("precision, guide", [("bf16", "none"), ("fp4", "all")])
def test_prompts_longer_than_the_budget_prefill_in_chunks_beside_decodes(sd, precision, guide):
    """Chunked prefill: with a token budget of 8, prompts of 39, 11 and 27 tokens run in chunks
    that fill each step beside the running samples' decodes (a prompt as long as the budget
    does not wait for them to finish), and give what whole-prompt prefill gives: the same
    tokens, log-probs and guidance bytes (a chunk's queries attend over the cached K/V of the
    chunks before, as a whole prompt's do)."""
    reqs = [GroupRequest("a", tuple(range(1, 40)), n=2), GroupRequest("b", tuple(range(50, 61)), n=3),
            GroupRequest("c", tuple(range(70, 97)), n=1)]
    params = SamplingParams(max_new_tokens=6, seed=5, temperature=1.0)
    whole = engine(sd, precision, guide=guide, max_batch_tokens=256).generate(reqs, params)
    chunked_engine = engine(sd, precision, guide=guide, max_batch_tokens=8)
    steps, schedule = [], chunked_engine.scheduler.schedule
    chunked_engine.scheduler.schedule = lambda *a, **k: steps.append(schedule(*a, **k)) or steps[-1]
    chunked = chunked_engine.generate(reqs, params)
    assert all(sum(len(seg.token_ids) for seg in w.segments) <= 8 for w in steps)
    assert any(w.decodes and w.partial is not None for w in steps)  # a prompt goes on beside decodes
    assert sum(len(w.prefills) for w in steps) == 3 and sum(w.partial is not None for w in steps) >= 5
    for x, y in zip(whole.samples, chunked.samples, strict=True):
        assert x.error is None and x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)
    assert whole.guidance.to_bytes() == chunked.guidance.to_bytes()
    assert chunked_engine.cache.allocator.num_free == 128 and chunked_engine.scheduler.committed == 0


@pytest.mark.parametrize("budget", [2048, 8])
def test_triton_kernels_decode_like_the_torch_path(sd, budget, monkeypatch):
    """The GPU path (FP4 GEMMs, paged FP4 decode attention; on the CPU under the Triton
    interpreter, on a GPU machine on the GPU) against the torch path: same greedy tokens,
    log-probs within accumulation-order noise. With a budget of 8 tokens g1's prompt is
    prefilled in chunks beside g0's decodes, whose attention then runs in the paged kernel too."""
    from sglang_rollout.engine import model

    mixed, paged = [], model.paged_decode_attention
    monkeypatch.setattr(model, "paged_decode_attention",
                        lambda q, *a, **k: mixed.append(q.shape[0]) or paged(q, *a, **k))
    params = SamplingParams(max_new_tokens=5, temperature=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CPU tensors only interpreted
    options = dict(device=device, cuda_graph_max_batch=0, max_batch_tokens=budget)
    torch_out = engine(sd, "fp4", kernels="torch", **options).generate(REQUESTS, params)
    assert not mixed  # the torch path never runs the paged kernel
    triton_out = engine(sd, "fp4", kernels="triton", **options).generate(REQUESTS, params)
    # decode-only steps give it all 5 samples (or fewer as they finish); mixed steps g0's 3
    assert (3 in mixed) == (budget == 8), mixed
    for a, b in zip(torch_out.samples, triton_out.samples, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=0.02, rtol=0)


def test_decode_graph_inputs_follow_growing_and_changing_sequences():
    """StepInputs (the host side of a CUDA-graph decode step) rewrites only what changed; after
    every step its buffers must equal a from-scratch build: tables padded with the scratch
    block, slot = table[pos // bs] * bs + pos % bs, length pos + 1, padding rows at position 0."""
    import numpy as np

    from sglang_rollout.engine.cuda_graphs import StepInputs
    from sglang_rollout.engine.model import Segment

    batch, width, scratch, bs = 4, 6, 99, 4
    inputs = StepInputs(batch, width, scratch, bs, pin=False)
    g = torch.Generator().manual_seed(0)
    tables = {i: [int(b) for b in torch.randint(0, 50, (1,), generator=g)] for i in range(6)}
    length = {i: 1 for i in tables}
    order = [0, 1, 2, 3]
    for step in range(40):
        if step % 7 == 6:  # a sequence finishes, another takes its place, rows shift
            order = order[1:] + [max(order) + 1] if max(order) + 1 < 6 else order[1:]
            for i in order:
                tables.setdefault(i, [int(torch.randint(0, 50, (), generator=g))])
                length.setdefault(i, 1)
        segs = []
        for i in order:
            length[i] += 1
            if (length[i] - 1) // bs >= len(tables[i]) and len(tables[i]) < width:
                tables[i] += [int(torch.randint(0, 50, (), generator=g))]  # grows in place
            pos = min(length[i] - 1, len(tables[i]) * bs - 1)
            segs.append(Segment([step + i], pos, tables[i]))
        inputs.fill(segs)
        want_tables = np.full((batch, width), scratch, dtype=np.int32)
        want_pos = np.zeros(batch, dtype=np.int64)
        for r, s in enumerate(segs):
            want_tables[r, :len(s.block_table)] = s.block_table
            want_pos[r] = s.start
        a = inputs.arrays
        assert (a["tables"] == want_tables).all(), step
        assert (a["pos"] == want_pos).all() and (a["lens"] == want_pos + 1).all()
        assert (a["slots"] == want_tables[np.arange(batch), want_pos // bs] * bs + want_pos % bs).all()
        assert list(a["ids"][:len(segs)]) == [s.token_ids[0] for s in segs] and not a["ids"][len(segs):].any()
    with pytest.raises(ValueError, match="cannot run this batch"):
        inputs.fill([Segment([1], 0, [1] * (width + 1))])
