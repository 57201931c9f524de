"""SGLang's own DeepSeek model (DeepseekV3ForCausalLM) running TRACE's FP4 policy on the CPU:
MLA through TRACE's forward over the FP4 latent pool (`mla.py`), the dense leading layer, shared
experts and sigmoid group-limited routing aligned with the trainer (`numerics.py`), every FP4
site through `trace_fp4`. Against the built-in engine (the same weights and tokens), the audit
of the Megatron trainer, and the trainer in `trace` mode fed SGLang's guidance.

The model is tests.support.hf_families' tiny DeepSeek-V3 (YaRN, q latent, 1 dense + 2 MoE
layers, 8 experts in 4 groups, one shared expert, scaled gates) and its variant without a
query latent (DeepSeek-V2-Lite's attention)."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.checkpoint.audit import audit
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import FP4_WEIGHT_SUFFIXES, fp4_weight_peers, from_hf
from megatron_trace.rl.metrics import mismatch_metrics
from megatron_trace.rollout import GroupRequest, SamplingParams
from sglang_rollout.engine import EngineConfig as BuiltinConfig
from sglang_rollout.engine import TraceEngine
from sglang_rollout.sglang import EngineConfig, SGLangEngine
from sglang_rollout.sglang.weight_payload import state_dict_buckets
from tests.support import scenarios as sc
from tests.support.hf_families import tiny_deepseek, tiny_deepseek_direct_q
from trace_kernels.fp4 import quantize

CONFIGS = {"q-latent": from_hf(tiny_deepseek().to_dict()), "direct-q": from_hf(tiny_deepseek_direct_q().to_dict()),
           # FFN widths SGLang's CPU TP2 does not pad (config.check_layout)
           "tp2": from_hf(tiny_deepseek(moe_intermediate_size=64, intermediate_size=128).to_dict())}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU machine: the same tests on CUDA
REQUESTS = [GroupRequest("g0", (1, 2, 3, 4, 5), n=3), GroupRequest("g1", (7, 8, 9, 10, 11, 12, 13), n=2)]
SAMPLING = SamplingParams(max_new_tokens=10, seed=4)
RUNS = {"fp4": ("q-latent", dict(precision="fp4", guide="all")),
        "fp4-direct-q": ("direct-q", dict(precision="fp4", guide="all")),
        "fp4-tp2": ("tp2", dict(precision="fp4", guide="all", tp_size=2)),
        "bf16": ("q-latent", dict(precision="bf16"))}


@pytest.fixture(scope="module")
def weights():
    return {name: sc.random_full_state_dict(cfg, seed=21) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def rollouts(weights):
    """{run: (RolloutOutput, quantization table)}, one SGLang engine alive at a time."""
    out = {}
    for run, (model, options) in RUNS.items():
        if options.get("tp_size", 1) > 1 and DEVICE == "cuda" and torch.cuda.device_count() < 2:
            continue
        engine = SGLangEngine(CONFIGS[model], EngineConfig(device=DEVICE, **options))
        try:
            engine.update_weights(weights[model], 0)
            out[run] = (engine.generate(REQUESTS, SAMPLING), engine.quantization_table())
        finally:
            engine.shutdown()
    return out


def builtin_scores(cfg, sd, precision, samples):
    """The built-in engine's log-probs of each sample's response (one forward over the whole sequence)."""
    builtin = TraceEngine(cfg, BuiltinConfig(precision=precision, block_size=4, num_blocks=128))
    builtin.update_weights(sd, 0)
    return [builtin.score(list(REQUESTS[int(s.group_id[1])].prompt_ids) + s.tokens)[s.prompt_len - 1:]
            for s in samples]


def test_sglangs_deepseek_in_fp4_computes_what_the_built_in_engine_computes(weights, rollouts):
    """SGLang's DeepSeek model, decoding token by token in its own batches and radix cache, gives
    the built-in engine's log-probabilities bit for bit in FP4, with and without a query latent:
    the same FP4 codes at every site and in the latent cache (measured: k3_kl 0, largest
    difference 0). Its BF16 engine (TRACE's MLA over SGLang's BF16 pool, SGLang's own BF16
    experts) agrees to BF16 noise (measured 2.2e-5)."""
    for run, (model, options) in RUNS.items():
        if options.get("tp_size", 1) > 1 or run not in rollouts:
            continue  # BF16 partial sums all-reduced: other roundings (the trainer test covers TP2)
        samples = rollouts[run][0].samples
        assert all(s.finish_reason in ("length", "stop") and s.tokens for s in samples), samples
        scored = builtin_scores(CONFIGS[model], weights[model], options["precision"], samples)
        k3 = mismatch_metrics(scored, [s.logprobs for s in samples])["k3_kl"]
        worst = max(float((a - s.logprobs.float()).abs().max()) for a, s in zip(scored, samples, strict=True))
        if options["precision"] == "fp4":
            assert k3 < 1e-12 and worst < 1e-5, (run, k3, worst)
        else:
            assert k3 < 1e-3, (run, k3)


def test_the_audit_finds_every_fp4_site_and_the_latent_cache_fp4(rollouts):
    """SGLang's table (read off the modules it built: the fused q/KV down projection, q_b, kv_b,
    the dense layer's and the shared experts' gate_up / down, the experts, the MLA pool) agrees
    with the Megatron trainer's and the built-in engine's."""
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.spawn import init_one_process

    init_one_process()
    for run in (r for r in ("fp4", "fp4-direct-q", "fp4-tp2") if r in rollouts):
        cfg = CONFIGS[RUNS[run][0]]
        table = rollouts[run][1]
        builtin = TraceEngine(cfg, BuiltinConfig(precision="fp4", num_blocks=4)).quantization_table()
        tables, problems = audit(cfg, build_model(cfg, "fp4-rne"), {"engine": builtin, "sglang": table})
        assert problems == [] and set(tables["sglang"]) == set(tables["trainer"]), (run, problems)
        assert table["model.layers.0.self_attn.kv_cache"] == "fp4" and table["model.layers.1.mlp.gate"] == "bf16"
        assert table["model.layers.1.mlp.shared_experts.down_proj"] == "fp4"
    assert set(rollouts["bf16"][1].values()) == {"bf16"}


@pytest.mark.parametrize("run", ["fp4", "fp4-direct-q", "fp4-tp2"])
def test_the_trainer_reproduces_sglangs_deepseek_rounding_from_its_guidance(weights, rollouts, run):
    """Fed the dense guidance SGLang recorded at every site (q/KV down, q_up, the latent, proj,
    the dense FFN, fc1, the experts' and the shared experts' fc2) and its routed experts (MoE
    layers only), the trace-mode trainer makes every one of SGLang's rounding decisions and gives
    its log-probs to FP32 rounding at TP1; at TP2 (rank slices merged back into whole rows) to the
    difference all-reduced BF16 partial sums make, far less than without guidance."""
    if run not in rollouts:
        pytest.skip(f"{run} needs 2 GPUs on a GPU machine")
    model = RUNS[run][0]
    out = rollouts[run][0]
    cfg = CONFIGS[model]
    group = out.guidance.groups["g0"]
    assert set(group.routed_experts) == set(cfg.moe_layers)
    sites = {site for _, site in group.records}
    assert {"qkv", "kv", "proj", "fc1", "fc2", "shared_fc2"} <= sites and ("q_up" in sites) == bool(cfg.q_lora_rank)
    got = spawn(sc.run_rollout_replay, {}, cfg=cfg, sd=weights[model], samples=out.samples, guidance=out.guidance,
                prompts={r.group_id: r.prompt_ids for r in REQUESTS})[0]
    engine_lp = [s.logprobs for s in out.samples]
    guided, rates = got["fp4-guided"]
    assert rates["residual_flip_rate"] == 0.0 and rates["flip_rate"] > 0, rates
    k3 = mismatch_metrics(guided, engine_lp)["k3_kl"]
    k3_unguided = mismatch_metrics(got["fp4-rne"][0], engine_lp)["k3_kl"]
    # on the H200 (2026-12-04) every decision is reproduced too, but k3_kl is 5.5e-6 (1.0e-5 without a
    # q latent): the trainer's high-precision MLA arithmetic on CUDA is not the engines' (not yet traced)
    bound = 1e-12 if RUNS[run][1].get("tp_size", 1) == 1 and DEVICE == "cpu" else 1e-4
    assert k3 < bound and k3 < k3_unguided / 10, (k3, k3_unguided)


def test_glm_attention_is_refused_by_the_sglang_engine():
    """GLM-4.5's attention (biases, half-rotary heads) is not aligned in SGLang yet: refused before
    any process starts, naming what is missing."""
    from tests.support.hf_families import tiny_glm

    with pytest.raises(ValueError, match="SGLang engine cannot build.*attention biases"):
        SGLangEngine(from_hf(tiny_glm().to_dict()), EngineConfig())


def packed_as_the_trainer_sends(cfg, sd):
    """sd with every FP4 weight packed, MLA's q and KV down projections with their joint amax
    (megatron.sync: `fp4_weight_peers` share one global scale)."""
    out = {}
    for name, t in sd.items():
        if not name.endswith(FP4_WEIGHT_SUFFIXES):
            out[name] = t
            continue
        amax = torch.stack([sd[p].abs().amax().float() for p in fp4_weight_peers(name, cfg) or (name,)]).amax()
        out[name] = quantize(t, "nvfp4", global_amax=amax)
    return out


def test_weight_updates_in_small_buckets_equal_a_fresh_load(weights, rollouts):
    """Updates in buckets of 16 KiB, so that the fused q/KV down projection's two weights arrive
    in different buckets (the loader holds the first until its peer is in) and large weights in
    slices: other weights in BF16 first, then the fixture's weights packed as the trainer sends
    them. The engine then generates exactly what the fixture's engine (a BF16 load, quantized on
    receipt with the peers' joint amax) generated."""
    cfg, sd = CONFIGS["q-latent"], weights["q-latent"]
    packed = packed_as_the_trainer_sends(cfg, sd)
    buckets = state_dict_buckets(cfg, packed, 1 << 14, fp4=True)
    where = {sub.name: i for i, group in enumerate(buckets.plan) for _, sub in group}
    down = [f"decoder.layers.{L}.self_attention.linear_{p}_down_proj.weight" for L in range(cfg.num_layers)
            for p in ("q", "kv")]
    assert any(where[q] != where[kv] for q, kv in zip(down[::2], down[1::2], strict=True)), where
    engine = SGLangEngine(cfg, EngineConfig(device=DEVICE, precision="fp4", weight_bucket_mb=1 / 64))
    try:
        engine.update_weights(sc.random_full_state_dict(cfg, seed=5), 0)
        first = engine.generate(REQUESTS, SAMPLING)
        engine.update_weights(packed, 1)
        got = engine.generate(REQUESTS, SAMPLING)
    finally:
        engine.shutdown()
    want = rollouts["fp4"][0]
    key = [(s.sample_id, tuple(s.tokens), tuple(s.logprobs.tolist())) for s in want.samples]
    assert [(s.sample_id, tuple(s.tokens), tuple(s.logprobs.tolist())) for s in first.samples] != key
    assert [(s.sample_id, tuple(s.tokens), tuple(s.logprobs.tolist())) for s in got.samples] == key
