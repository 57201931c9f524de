"""SGLang's real Engine running TRACE's FP4 policy on the CPU (the RolloutBackend contract is
tests/sglang_rollout/test_backend_contract.py): every FP4 site and the KV cache quantized as the
trainer's, the trainer reproducing SGLang's rounding from its guidance, tensor parallelism, and
what separates SGLang's FP4 from the built-in engine's.

The model is the `tiny` preset with experts twice as wide (64), so that SGLang's TP2 needs no
padding of the experts (it keeps each rank's part a multiple of 32)."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.checkpoint.audit import audit
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import FP4_WEIGHT_SUFFIXES, PRESETS
from megatron_trace.rl.metrics import mismatch_metrics
from megatron_trace.rollout import GroupRequest, SamplingParams
from sglang_rollout.engine import EngineConfig as BuiltinConfig
from sglang_rollout.engine import TraceEngine
from sglang_rollout.sglang import EngineConfig, SGLangEngine
from sglang_rollout.sglang.weight_payload import state_dict_buckets
from tests.support import scenarios as sc
from trace_kernels.fp4 import quantize

CFG = PRESETS["tiny"].replace(moe_intermediate_size=64)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU machine: the same tests on CUDA
REQUESTS = [GroupRequest("g0", (1, 2, 3, 4, 5), n=3), GroupRequest("g1", (7, 8, 9, 10, 11, 12, 13), n=2)]
SAMPLING = SamplingParams(max_new_tokens=12, seed=4)
PROMPTS = {r.group_id: r.prompt_ids for r in REQUESTS}
BEFORE_FIRST_REDUCTION = ("qkv", "k", "v", "proj")  # layer 0's sites that no TP all-reduce precedes


@pytest.fixture(scope="module")
def sd():
    return sc.random_full_state_dict(CFG, seed=21)


@pytest.fixture(scope="module")
def rollouts(sd):
    """{name: (RolloutOutput, quantization table)} of SGLang engines in FP4 (TP1, TP2 and TP2 with
    SGLang's EP2, guidance on every layer; TP1 and TP2 also in the sparse coding) and BF16, one
    engine alive at a time (TP2 on a GPU machine: with 2 GPUs)."""
    out = {}
    configs = {"fp4": dict(precision="fp4", guide="all"), "fp4-tp2": dict(precision="fp4", guide="all", tp_size=2),
               "fp4-ep2": dict(precision="fp4", guide="all", tp_size=2, sglang={"ep_size": 2}),
               "fp4-sparse": dict(precision="fp4", guide="all", coding="sparse", scale_coding="near"),
               "fp4-tp2-sparse": dict(precision="fp4", guide="all", tp_size=2, coding="sparse"),
               "fp4-page16": dict(precision="fp4", guide="all", sglang={"page_size": 16}),
               "bf16": dict(precision="bf16")}
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        del configs["fp4-tp2"], configs["fp4-ep2"], configs["fp4-tp2-sparse"]
    if DEVICE == "cuda":  # "fp4" decodes through CUDA graphs there; this one without
        configs["fp4-eager"] = dict(precision="fp4", guide="all", sglang={"disable_cuda_graph": True})
    for name, options in configs.items():
        engine = SGLangEngine(CFG, EngineConfig(device=DEVICE, **options))
        try:
            engine.update_weights(sd, 0)
            out[name] = (engine.generate(REQUESTS, SAMPLING), engine.quantization_table())
        finally:
            engine.shutdown()
    return out


def test_every_fp4_site_runs_trace_fp4_and_the_kv_cache_is_nvfp4(rollouts):
    """The audit's SGLang column, read off the modules SGLang built, agrees with the trainer and
    the built-in engine; a BF16 SGLang engine is all BF16, and the audit says where it disagrees."""
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.spawn import init_one_process

    init_one_process()
    builtin = TraceEngine(CFG, BuiltinConfig(precision="fp4", num_blocks=4)).quantization_table()
    fp4_table, bf16_table = rollouts["fp4"][1], rollouts["bf16"][1]
    tables, problems = audit(CFG, build_model(CFG, "fp4-rne"), {"engine": builtin, "sglang": fp4_table})
    assert problems == [] and set(tables["sglang"]) == set(tables["trainer"])
    assert sum(v == "fp4" for v in fp4_table.values()) == sum(v == "fp4" for v in builtin.values()) > 0
    assert fp4_table["model.layers.1.self_attn.kv_cache"] == "fp4" and fp4_table["model.layers.0.mlp.gate"] == "bf16"
    assert set(bf16_table.values()) == {"bf16"}
    _, problems = audit(CFG, build_model(CFG, "fp4-rne"), {"engine": builtin, "sglang": bf16_table})
    assert any("q_proj" in p and "sglang=bf16" in p for p in problems)


def test_the_trainer_reproduces_sglangs_rounding_from_its_guidance(sd, rollouts):
    """Fed SGLang's dense guidance and routed experts, the trace-mode trainer makes every one of
    SGLang's FP4 rounding decisions (TP1, TP2 and EP2 engines: under EP each fc2 row comes from
    its expert's rank). At TP1, where SGLang's model computes the trainer's arithmetic
    (numerics.py), the log-probs agree to FP32 rounding (k3_kl at the built-in engine's level,
    ~1e-14; it was 1.6e-5 with SGLang's own norms, rotary and router); under TP the all-reduced
    BF16 partial products differ from the trainer's whole products, far less than without guidance."""
    for name in ("fp4", "fp4-tp2", "fp4-ep2", "fp4-page16"):
        if name not in rollouts:
            continue
        out = rollouts[name][0]
        got = spawn(sc.run_rollout_replay, {}, cfg=CFG, sd=sd, prompts=PROMPTS, samples=out.samples,
                    guidance=out.guidance, grouped_gemm=True)[0]
        engine_lp = [s.logprobs for s in out.samples]
        guided, rates = got["fp4-guided"]
        assert rates["residual_flip_rate"] == 0.0 and rates["flip_rate"] > 0, (name, rates)
        k3 = mismatch_metrics(guided, engine_lp)["k3_kl"]
        k3_unguided = mismatch_metrics(got["fp4-rne"][0], engine_lp)["k3_kl"]
        assert k3 < (1e-12 if name == "fp4" else 1e-4) and k3 < k3_unguided / 10, (name, k3, k3_unguided)


def test_sparse_guidance_ships_the_dense_records_bits_and_the_trainer_follows_it(sd, rollouts):
    """The sparse coding (rl.coding=sparse; TP1 with "near" scale coding, TP2 with "lsb"): each
    record ships exactly the dense engine's mantissa bits at the positions it lists, its global
    scales and the scales its coding keeps (the dense engine on the same seeds is the reference;
    under TP2 every rank's columns or heads merged back into whole rows). Fed the TP1 engine's
    sparse guidance, the trace-mode trainer reconstructs the unshipped bits from its own rounding
    and comes an order of magnitude and more closer to SGLang than without guidance (flips are
    counted against dense records only). How close is the coding's matter, not SGLang's: the
    built-in engine's sparse guidance gives the same on this model (k3_kl 9e-5 with "lsb",
    2.8e-4 with "near" at tau 2 ulps; 1.2e-14, as dense, at tau 64)."""
    for dense, sparse, scale_coding in (("fp4", "fp4-sparse", "near"), ("fp4-tp2", "fp4-tp2-sparse", "lsb")):
        if sparse in rollouts:
            assert sc.sparse_ships_dense_bits(rollouts[dense][0], rollouts[sparse][0], scale_coding) > 0, sparse
    out = rollouts["fp4-sparse"][0]
    got = spawn(sc.run_rollout_replay, {}, cfg=CFG, sd=sd, prompts=PROMPTS, samples=out.samples,
                guidance=out.guidance, grouped_gemm=True)[0]
    engine_lp = [s.logprobs for s in out.samples]
    k3, k3_unguided = (mismatch_metrics(got[p][0], engine_lp)["k3_kl"] for p in ("fp4-guided", "fp4-rne"))
    assert k3 < k3_unguided / 10, (k3, k3_unguided)


def test_pages_of_16_tokens_give_what_pages_of_one_give(rollouts):
    """SGLang with pages of 16 tokens (what the CUDA split-K attention kernel reads) caches only a
    finished request's whole pages, so the feed of each sample's last token recomputes the tail:
    the samples, log-probs, routed experts and every guidance row but the last token's are those
    of pages of one token, byte for byte (they are what the sample's own request ran), and the
    last token's rows are there."""
    one, page16 = rollouts["fp4"][0], rollouts["fp4-page16"][0]
    for a, b in zip(one.samples, page16.samples, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs), a.sample_id
    for g in ("g0", "g1"):
        x, y = one.guidance.groups[g], page16.guidance.groups[g]
        assert x.routed_experts.keys() == y.routed_experts.keys() and x.records.keys() == y.records.keys()
        assert all(torch.equal(x.routed_experts[k], y.routed_experts[k]) for k in x.routed_experts)
        assert all(torch.equal(x.records[k].payload[p], y.records[k].payload[p]) for k in x.records
                   for p in x.records[k].payload)
    for s in one.samples:
        x, y = one.guidance.samples[s.sample_id], page16.guidance.samples[s.sample_id]
        assert x.records.keys() == y.records.keys() and x.routed_experts.keys() == y.routed_experts.keys()
        for k, e in x.routed_experts.items():
            assert e.shape == y.routed_experts[k].shape and torch.equal(e[:-1], y.routed_experts[k][:-1])
        for k, r in x.records.items():
            per = r.payload["bits"].shape[0] // len(s.tokens)
            for p, t in r.payload.items():
                u = y.records[k].payload[p]
                if t.dim() and t.shape[0] == per * len(s.tokens):  # row-wise parts: all but the last token's
                    assert t.shape == u.shape and torch.equal(t[:-per], u[:-per]), (s.sample_id, k, p)


@pytest.mark.skipif(DEVICE != "cuda",
                    reason="SGLang runs no CUDA graphs on the CPU (test_capture.py stages as they do)")
def test_decode_cuda_graphs_capture_the_guidance_eager_decode_captures(rollouts):
    """With guidance on, SGLang's decode steps replay CUDA graphs whose guidance rows are staged
    on the device (capture.graph_capture): the samples and every guidance record equal those of
    the same engine with CUDA graphs off, byte for byte."""
    graphs, eager = rollouts["fp4"][0], rollouts["fp4-eager"][0]
    for a, b in zip(graphs.samples, eager.samples, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs), a.sample_id
    for name in ("groups", "samples"):
        x, y = getattr(graphs.guidance, name), getattr(eager.guidance, name)
        assert x.keys() == y.keys()
        for g in x:
            assert x[g].records.keys() == y[g].records.keys()
            for k, r in x[g].records.items():
                assert all(torch.equal(t, y[g].records[k].payload[p]) for p, t in r.payload.items()), (g, k)


def test_tp2_and_ep2_round_as_tp1_up_to_the_first_all_reduce(rollouts):
    """SGLang's TP2 shards the FP4 sites (heads, columns; with EP2 the experts go whole to one
    rank each) and quantizes each row with its whole row's global scale, so what it captures
    before any all-reduce is byte for byte TP1's, prompts and samples alike; after the attention
    output's all-reduce, BF16 partial sums make the two differ as any tensor-parallel engine's
    do (the trainer follows either exactly)."""
    if "fp4-tp2" not in rollouts:
        pytest.skip("TP2 on a GPU machine needs 2 GPUs")
    for name in ("fp4-tp2", "fp4-ep2"):
        _same_bytes_before_the_first_all_reduce(rollouts["fp4"][0], rollouts[name][0])


def _same_bytes_before_the_first_all_reduce(tp1, tp2):
    owners = [(tp1.guidance.groups[g], tp2.guidance.groups[g]) for g in ("g0", "g1")]
    owners += [(tp1.guidance.samples[a.sample_id], tp2.guidance.samples[b.sample_id])
               for a, b in zip(tp1.samples, tp2.samples, strict=True) if a.tokens == b.tokens]
    assert len(owners) > 2
    for one, two in owners:
        for site in BEFORE_FIRST_REDUCTION:
            r1, r2 = one.records[(0, site)], two.records[(0, site)]
            assert all(torch.equal(r1.payload[k], r2.payload[k]) for k in r1.payload), site
    later = [(one.records[(1, "qkv")], two.records[(1, "qkv")]) for one, two in owners]
    assert any(not torch.equal(a.payload["bits"], b.payload["bits"]) for a, b in later)  # the test can tell


def test_sglangs_fp4_engine_computes_what_the_built_in_engine_computes(sd, rollouts):
    """The same weights and tokens scored by the built-in engine (one forward over each whole
    sequence): SGLang's FP4 engine at TP1, which decoded them token by token in its own batches,
    pages and radix cache, gives the same log-probabilities to FP32 rounding, so the same FP4
    codes everywhere (without numerics.py its norms, rotary and router flipped codes: k3_kl
    1.5e-2). Its BF16 engine (SGLang's own attention over a BF16 pool) agrees to BF16 noise.
    On a GPU machine SGLang runs CUDA kernels while the built-in engine scores on the CPU; the
    non-FP4 operations (rsqrt, exp, sin/cos, SiLU) and the GEMMs' summation order differ by
    ulps between the two, which would move some activations across E2M1 rounding points (not
    traced code by code), so only the size of that gap is checked there (H100, 2026-12-05: k3_kl 9.3e-4, worst log-prob
    0.13; the trainer fed SGLang's guidance agrees with SGLang's CUDA log-probs to 1e-12
    there, the test above)."""
    k3, worst = {}, {}
    for precision in ("bf16", "fp4"):
        out = rollouts[precision][0]
        builtin = TraceEngine(CFG, BuiltinConfig(precision=precision, block_size=4, num_blocks=128))
        builtin.update_weights(sd, 0)
        scored = [builtin.score(list(REQUESTS[int(s.group_id[1])].prompt_ids) + s.tokens)[s.prompt_len - 1:]
                  for s in out.samples]
        k3[precision] = mismatch_metrics(scored, [s.logprobs for s in out.samples])["k3_kl"]
        worst[precision] = max(float((a - b.float()).abs().max()) for a, b in
                               zip(scored, [s.logprobs for s in out.samples], strict=True))
    if DEVICE == "cpu":
        assert k3["fp4"] < 1e-12 and worst["fp4"] < 1e-5, (k3, worst)
    else:  # a third of the gap SGLang's own norms, rotary and router gave on the CPU (1.5e-2)
        assert k3["fp4"] < 5e-3, (k3, worst)
    assert k3["bf16"] < 1e-3, k3


def test_released_memory_is_taken_back_and_the_weights_sent_again(sd, rollouts):
    """Colocated with a trainer (EngineConfig.release_memory), the engine gives its memory back
    between rollouts (SGLang's release/resume_memory_occupation; freed with torch_memory_saver on
    a GPU, its bookkeeping alone on the CPU), refuses to generate or take weights while released,
    and after resuming until every weight was sent again; then it generates what it did before.
    Its updates go in 32 KiB buckets, large weights in slices the scheduler processes put
    together: it generates what the engine loaded in one bucket generated."""
    engine = SGLangEngine(CFG, EngineConfig(device=DEVICE, precision="fp4", guide="all", release_memory=True,
                                            weight_bucket_mb=1 / 32, num_blocks=1 << 16 if DEVICE == "cuda" else 512))
    try:
        engine.update_weights(sd, 0)
        before = engine.generate(REQUESTS, SAMPLING)
        free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 0
        engine.release_memory()
        freed = torch.cuda.mem_get_info()[0] - free if DEVICE == "cuda" else 0
        with pytest.raises(RuntimeError, match="released"):
            engine.generate(REQUESTS, SAMPLING)
        with pytest.raises(RuntimeError, match="released"):
            engine.update_weights(sd, 1)
        engine.resume_memory()
        with pytest.raises(RuntimeError, match="not sent again"):
            engine.generate(REQUESTS, SAMPLING)
        engine.update_weights(sd, 1)
        after = engine.generate(REQUESTS, SAMPLING)
    finally:
        engine.shutdown()
    assert [sample_key(s) for s in before.samples] == [sample_key(s) for s in rollouts["fp4"][0].samples]
    assert [s.tokens for s in after.samples] == [s.tokens for s in before.samples]
    for a, b in zip(after.samples, before.samples, strict=True):
        assert torch.equal(a.logprobs, b.logprobs)
    if DEVICE == "cuda":  # at least the KV pool: 2^20 token slots x 2 KV heads x 13 bytes, K and V, 2 layers
        assert freed > 100 * 2**20, freed


def test_weights_broadcast_over_a_weight_group_equal_a_fresh_load(sd, rollouts):
    """The disaggregated path: this process opens a weight group with SGLang's scheduler
    processes (gloo: on a GPU machine this process and the engine share a GPU, which NCCL
    refuses; TP2 where it runs) and broadcasts each update in buckets. Other weights in BF16
    first, then `sd` packed in FP4: the engine then generates exactly what an engine loaded with
    `sd` through update_weights_from_tensor generated, tokens, log-probs and guidance bytes;
    a stale or misfit update is refused before anything is sent."""
    name = "fp4-tp2" if "fp4-tp2" in rollouts else "fp4"
    packed = {k: quantize(v, "nvfp4") if k.endswith(FP4_WEIGHT_SUFFIXES) else v for k, v in sd.items()}
    parts = state_dict_buckets(CFG, packed, 1 << 15, fp4=True)
    assert len(parts) > 2 and any(sub.shape != sub.full_shape for group in parts.plan for _, sub in group)
    engine = SGLangEngine(CFG, EngineConfig(device=DEVICE, precision="fp4", guide="all", weight_bucket_mb=1 / 32,
                                            tp_size=2 if name == "fp4-tp2" else 1))
    try:
        engine.connect_weight_group(backend="gloo")  # NCCL refuses two ranks on one GPU, as here on a GPU machine
        other = sc.random_full_state_dict(CFG, seed=5)
        engine.update_weights(other, 0)
        first = engine.generate(REQUESTS, SAMPLING)
        engine.update_weights(packed, 1)
        got = engine.generate(REQUESTS, SAMPLING)
        with pytest.raises(ValueError, match="not newer"):
            engine.update_weights(other, 1)
        misfit = dict(other, **{"output_layer.weight": other["output_layer.weight"][:, :32]})
        with pytest.raises(ValueError, match="output_layer.weight"):
            engine.update_weights(misfit, 2)
        again = engine.generate(REQUESTS, SAMPLING)
    finally:
        engine.shutdown()
    want = rollouts[name][0]
    assert [sample_key(s) for s in first.samples] != [sample_key(s) for s in want.samples]
    for out in (got, again):
        assert [sample_key(s) for s in out.samples] == [sample_key(s) for s in want.samples]
        assert {s.weight_version for s in out.samples} == {1}
        for owners in ("groups", "samples"):
            mine, theirs = getattr(out.guidance, owners), getattr(want.guidance, owners)
            assert mine.keys() == theirs.keys()
            for owner, g in mine.items():
                for site, record in g.records.items():
                    ref = theirs[owner].records[site].payload
                    assert all(torch.equal(record.payload[k], ref[k]) for k in ref), (owner, site)


def test_an_hf_checkpoint_loaded_by_sglangs_own_loaders_runs_the_same_fp4_policy(sd, rollouts, tmp_path):
    """EngineConfig.checkpoint: SGLang reads a BF16 HF checkpoint that transformers wrote (sharded
    safetensors) through its own loaders (TP sharding, Q/K/V and gate/up fused), and trace_fp4
    packs it after loading, the global scales' amax all-reduced over the TP ranks. At TP1 its FP4
    log-probs are the built-in engine's on the checkpoint's weights (to FP32 rounding); at TP2
    (where it runs) what it records before the first all-reduce is TP1's byte for byte; a
    checkpoint of another model is refused."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_trace.checkpoint.hf import HFCheckpoint
    from megatron_trace.checkpoint.hf_layout import hf_config, megatron_to_hf

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config(CFG))).to(torch.bfloat16)
    model.load_state_dict(megatron_to_hf(sd, CFG), strict=False)  # (its rotary buffers are not weights)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    weights = dict(HFCheckpoint(tmp_path))  # what the checkpoint holds (its norms rounded to BF16)
    outs = {}
    for tp in (1, 2) if "fp4-tp2" in rollouts else (1,):
        engine = SGLangEngine(CFG, EngineConfig(device=DEVICE, precision="fp4", guide="all", tp_size=tp,
                                                checkpoint=str(tmp_path)))
        try:
            assert engine.weight_version == 0
            outs[tp] = engine.generate(REQUESTS, SAMPLING)
        finally:
            engine.shutdown()
    builtin = TraceEngine(CFG, BuiltinConfig(precision="fp4", block_size=4, num_blocks=128))
    builtin.update_weights(weights, 0)
    scored = [builtin.score(list(PROMPTS[s.group_id]) + s.tokens)[s.prompt_len - 1:] for s in outs[1].samples]
    got = [s.logprobs for s in outs[1].samples]
    assert mismatch_metrics(scored, got)["k3_kl"] < 1e-12
    assert max(float((a - b.float()).abs().max()) for a, b in zip(scored, got, strict=True)) < 1e-5
    if 2 in outs:
        _same_bytes_before_the_first_all_reduce(outs[1], outs[2])
    with pytest.raises(ValueError, match="not the engine's model"):
        SGLangEngine(CFG.replace(rms_norm_eps=1e-5), EngineConfig(precision="fp4", checkpoint=str(tmp_path)))


def test_the_engines_start_never_holds_the_bf16_weights_of_its_fp4_sites():
    """An engine TRACE starts creates its FP4 sites packed (quant.packed_at_start): its scheduler
    process never holds their BF16 shard (401 MB here: 128 experts of width 512, two layers), so
    its peak memory (the OS's resident set on the CPU, torch's allocator on a GPU) exceeds what
    it holds after the start by far less than that. Packing after a BF16 load (SGLang's path for
    a BF16 checkpoint) frees the BF16 shard again: its peak ends 1.6 GB above (measured on the CPU,
    the shard and the quantizer's FP32 temporaries), which this test refuses."""
    cfg = CFG.replace(hidden_size=512, num_experts=128, moe_intermediate_size=512, top_k=2)
    bf16_bytes = 2 * cfg.num_layers * (cfg.num_experts * 3 * 512 * 512 + 512 * 16 * (4 + 2 * 2) + 4 * 16 * 512)
    engine = SGLangEngine(cfg, EngineConfig(device=DEVICE, precision="fp4", guide="none", num_blocks=64))
    try:
        ranks = engine.memory()
    finally:
        engine.shutdown()
    for rank in ranks:
        assert rank["device"] == DEVICE and rank["now"] > 0
        assert rank["peak"] - rank["now"] < bf16_bytes / 4, (rank, bf16_bytes)


def sample_key(sample):
    return sample.sample_id, tuple(sample.tokens), tuple(sample.logprobs.tolist()), sample.finish_reason


def test_a_layout_sglang_would_pad_is_refused():
    with pytest.raises(ValueError, match="pads each rank's part to a multiple of 32"):
        SGLangEngine(PRESETS["tiny"], EngineConfig(precision="fp4", tp_size=2))
    with pytest.raises(ValueError, match="ep_size 4 does not divide the 6 experts"):
        SGLangEngine(CFG.replace(num_experts=6), EngineConfig(precision="fp4", tp_size=4, sglang={"ep_size": 4}))
