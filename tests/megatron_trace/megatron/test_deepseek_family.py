"""The DeepSeek-V3 family in the Megatron trainer (issue 27): tiny DeepSeek-V3 (MLA, shared experts,
a dense leading layer, sigmoid group-limited routing with an expert bias) and GLM-4.5 (GQA with
biases, q/k norm and half-rotary heads) models built by `transformers`, against transformers' own
forward in float32, under TP2, EP2 and PP2 (each layout's arithmetic differs from one process's,
so one process is not run apart); HF -> Megatron -> HF bit-identical through the real
converter; the expert-bias update against DeepSeek-V3's rule re-derived in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_trace.checkpoint import convert
from megatron_trace.checkpoint.hf import HFCheckpoint
from megatron_trace.checkpoint.hf_layout import config_from_hf, hf_config
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import from_hf
from tests.support import scenarios as sc
from tests.support.hf_families import hf_model, routed_experts, run_expert_bias_update
from tests.support.ranks import skip_unless_gpus_for

LAYERS = 4  # a dense layer then three MoE layers: PP2 splits them 2 + 2


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> the family's tiny model, its Megatron state dict and reference logits (built once)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _family(name, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


@pytest.fixture(params=["deepseek-v3", "glm-4.5"])
def family(request, families):
    return families(request.param)


def _family(name, tmp):
    config, model = hf_model(name, num_hidden_layers=LAYERS)
    cfg = from_hf(config.to_dict())
    hf_dir = tmp / "hf"
    model.save_pretrained(hf_dir)  # float32, in the Hub's on-disk layout
    sd = dict(HFCheckpoint(hf_dir).items())
    gen = torch.Generator().manual_seed(3)
    # two batches (one per rank under EP2's data parallelism) of 16 and 10 tokens: sequence
    # parallelism splits them
    batches = [[torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths] for lengths in ((9, 7), (4, 6))]
    with torch.no_grad():
        want = [torch.cat([model(s[None]).logits[0] for s in seqs]) for seqs in batches]
    return dict(name=name, cfg=cfg, sd=sd, batches=batches, want=want, model=model, hf_dir=hf_dir)


def test_config_reads_back_and_only_the_sglang_engine_lacks_the_family(family):
    cfg = family["cfg"]
    assert from_hf(hf_config(cfg)) == cfg and config_from_hf(hf_config(cfg)) == cfg
    if cfg.mla:  # the routing keys of DeepSeek-V3's released config.json, which servers read
        assert {k: hf_config(cfg)[k] for k in ("topk_method", "scoring_func", "moe_layer_freq")} == {
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    assert cfg.unbuilt_in("megatron") == "" and cfg.unbuilt_in("engine") == "" and "not built yet" in cfg.unbuilt
    with pytest.raises(ValueError, match="TRACE's SGLang engine cannot build this"):
        cfg.require_built("TRACE's SGLang engine")


@pytest.mark.parametrize("name, layout", [
    ("deepseek-v3", dict(tp=2)), ("deepseek-v3", dict(ep=2, dp=2)), ("deepseek-v3", dict(pp=2)),
    ("glm-4.5", dict(tp=2)),  # its MoE layers and stages are DeepSeek-V3's
    ("deepseek-v3-direct-q", dict(tp=2)),  # MLA without the query latent (q_lora_rank null)
], ids=["deepseek-v3-tp2", "deepseek-v3-ep2", "deepseek-v3-pp2", "glm-4.5-tp2", "deepseek-v3-direct-q-tp2"])
def test_logits_match_transformers_in_float32(families, name, layout):
    skip_unless_gpus_for(layout)
    family = families(name)
    runs = spawn(sc.run_layout, layout, cfg=family["cfg"], sd=family["sd"],
                 batches=[{"seqs": seqs} for seqs in family["batches"]], modes=["bf16", "fp4-rne"], backward=True,
                 params_dtype=torch.float32)
    last = [(b, out) for run in runs for b, out in run.items() if out["logits"]]
    copies = 2 if "tp" in layout else 1  # every batch, on each last-stage rank
    assert sorted(b for b, _ in last) == [0] * copies + [1] * copies
    for b, out in last:
        got, fp4 = out["logits"]["bf16"], out["logits"]["fp4-rne"]
        err = (got - family["want"][b]).abs().max()
        assert err < 1e-4, f"{family['name']} {layout}: logits differ from transformers' by {float(err):.2e}"
        # the FP4 sites act: quantization moves logits far more than float32 arithmetic does
        assert (fp4 - got).abs().max() > 1e-2
        assert out["grads_finite"]


def test_hf_to_megatron_to_hf_is_bit_identical(family, tmp_path):
    from safetensors.torch import load_file

    released = copy.deepcopy(family["model"]).to(torch.bfloat16)  # as released: BF16 but the FP32 expert bias
    for gate in (m for m in released.modules() if hasattr(m, "e_score_correction_bias")):
        gate.e_score_correction_bias = gate.e_score_correction_bias.float()
    released.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    convert.hf_to_megatron(tmp_path / "hf", tmp_path / "meg", tp=2)
    convert.megatron_to_hf(tmp_path / "meg", tmp_path / "back")

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
    a, b = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_expert_bias_is_updated_by_deepseeks_rule_from_the_routed_tokens(families):
    family = families("deepseek-v3")  # GLM-4.5's router is the same Megatron router
    cfg, seqs = family["cfg"], family["batches"][0]
    out = spawn(run_expert_bias_update, {}, cfg=cfg, sd=family["sd"], seqs=seqs)[0]
    picked = routed_experts(family["model"], seqs)  # transformers' routers on the same tokens
    moe_layers = [L for L in range(cfg.num_layers) if cfg.is_moe_layer(L)]
    assert sorted(out) == [f"decoder.layers.{L}.mlp.router" for L in moe_layers]
    for L in moe_layers:
        tokens, before, after = out[f"decoder.layers.{L}.mlp.router"]
        assert torch.equal(tokens, torch.bincount(picked[L].reshape(-1), minlength=cfg.num_experts).float())
        load = tokens.double()
        want = before.double() + 1e-3 * torch.sign(load.mean() - load)  # DeepSeek-V3: b += u * sign(mean - load)
        torch.testing.assert_close(after.double(), want, rtol=0, atol=1e-7)
        assert not torch.equal(after, before)
