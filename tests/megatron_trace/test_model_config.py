"""ModelConfig for the three HF families (Qwen3-MoE, DeepSeek-V3, GLM-4.5) against transformers' own
configs and models: the fields read from a config.json, and the parameter count against the model
transformers builds from it (on the meta device: no memory, DeepSeek-V3's 671 B included)."""

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_trace.checkpoint.hf_layout import config_from_hf
from megatron_trace.model_config import PRESETS, ModelConfig, from_hf
from megatron_trace.rl.architecture import Architecture
from tests.support.hf_families import tiny_deepseek, tiny_glm


def hf_param_count(model_cls, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_cls(config).parameters())


@pytest.mark.parametrize("name, model_cls, config", [
    ("qwen3-moe", Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    ("deepseek-v3", DeepseekV3ForCausalLM, tiny_deepseek()),
    ("deepseek-v2-lite-style (no q_lora)", DeepseekV3ForCausalLM, tiny_deepseek(q_lora_rank=None)),
    ("glm-4.5", Glm4MoeForCausalLM, tiny_glm()),
    ("glm-4.5 without qk norm and bias", Glm4MoeForCausalLM, tiny_glm(use_qk_norm=False, attention_bias=False)),
])
def test_fields_and_parameter_count_against_transformers(name, model_cls, config):
    cfg = from_hf(config.to_dict())
    assert cfg.num_params == hf_param_count(model_cls, config), name
    assert (cfg.num_layers, cfg.top_k, cfg.moe_intermediate_size) == (
        config.num_hidden_layers, config.num_experts_per_tok, config.moe_intermediate_size)


def test_each_familys_pieces_are_read_and_named_as_unbuilt():
    ds = from_hf(tiny_deepseek().to_dict())
    assert ds.mla and ds.head_dim == 32 and ds.kv_lora_rank == 32 and ds.q_lora_rank == 48
    assert (ds.scoring_func, ds.n_group, ds.topk_group, ds.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (ds.first_k_dense_replace, ds.intermediate_size, ds.n_shared_experts) == (1, 96, 1)
    assert not ds.is_moe_layer(0) and ds.is_moe_layer(1)
    for piece in ("multi-head latent attention", "shared experts", "dense leading layers", "sigmoid routing",
                  "group-limited top-k", "scaled routed gates"):
        assert piece in ds.unbuilt  # by the DeepSpeed trainer
    # the Megatron trainer, the built-in engine and the SGLang engine build them all
    assert ds.unbuilt_in("megatron") == "" and ds.unbuilt_in("engine") == "" and ds.unbuilt_in("sglang") == ""
    glm = from_hf(tiny_glm().to_dict())
    assert not glm.mla and glm.use_qk_norm and glm.attention_bias and glm.partial_rotary_factor == 0.5
    assert "attention biases" in glm.unbuilt and "partial rotary embeddings" in glm.unbuilt
    assert glm.unbuilt_in("megatron") == "" and glm.unbuilt_in("engine") == ""
    # SGLang's GLM-4.5 attention is not aligned with the trainer: its attention pieces, not the rest
    assert glm.unbuilt_in("sglang").startswith("attention biases (attention_bias=True), partial rotary")
    assert "attention without q/k norm" in from_hf(tiny_glm(use_qk_norm=False).to_dict()).unbuilt
    # YaRN is built on MLA's rope part (Megatron's MLA has it), not on GQA heads
    assert ds.rope_type == "yarn" and (ds.rope_factor, ds.original_max_position_embeddings) == (4.0, 128)
    yarn_glm = from_hf(tiny_glm(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                 "original_max_position_embeddings": 128}).to_dict())
    assert "yarn RoPE scaling" in yarn_glm.unbuilt_in("engine")
    with pytest.raises(ValueError, match="YaRN with mscale=0.5 needs mscale_all_dim > 0"):
        ds.replace(mscale=0.5, mscale_all_dim=0.0)
    with pytest.raises(ValueError, match="the DeepSpeed trainer cannot build this deepseek_v3 model: multi-head"):
        ds.require_built("the DeepSpeed trainer")
    with pytest.raises(ValueError, match="part must be one of"):
        ds.unbuilt_in("deepspeed")
    # what the Megatron trainer does not build either: named, and conversion refuses it
    for changes, piece in ((dict(num_experts_per_tok=2), "group-limited top-k (n_group=4, topk_group=2, top_k=2)"),
                           (dict(norm_topk_prob=False), "unnormalised top-k gates"),
                           (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
                            "linear RoPE scaling")):
        cfg = from_hf(tiny_deepseek(**changes).to_dict())
        assert piece in cfg.unbuilt_in("megatron") and piece in cfg.unbuilt_in("engine")
        with pytest.raises(ValueError, match="converting this HF deepseek_v3 checkpoint cannot build"):
            config_from_hf(tiny_deepseek(**changes).to_dict())
    for name in ("tiny", "demo", "small", "moe-0.4b", "qwen3-30b-a3b", "qwen3-235b-a22b"):
        assert PRESETS[name].unbuilt == "" and PRESETS[name].model_type == "qwen3_moe"


def test_deepseek_v3_preset_is_the_released_config():
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's config.json (but for context length
    and YaRN): the preset must agree on the architecture and count transformers' 671 B parameters."""
    preset, reference = PRESETS["deepseek-v3"], from_hf(DeepseekV3Config().to_dict())
    no_yarn = dict(rope_type="default", rope_factor=1.0, original_max_position_embeddings=0, mscale_all_dim=0.0)
    assert preset.replace(max_position_embeddings=reference.max_position_embeddings, **no_yarn) == reference
    assert (preset.rope_factor, preset.original_max_position_embeddings, preset.mscale_all_dim) == (40, 4096, 1.0)
    assert preset.num_params == hf_param_count(DeepseekV3ForCausalLM, DeepseekV3Config())  # 671.0 B
    assert "yarn RoPE scaling" in preset.unbuilt and preset.unbuilt_in("engine") == ""
    arch = Architecture.from_model_config("deepseek-v3", preset)
    assert (arch.kv_heads, arch.kv_width, arch.attn_out_width) == (1, 512 + 64, 128 * 128)  # the MLA latent cache
    # docs/design.md 3.1: the latent in NVFP4 (codes, E4M3 per 16, one float32 g), the rope key BF16
    assert arch.kv_bytes_per_token(fp4=True) == 512 / 2 + 512 / 16 + 4 + 64 * 2 == 420
    assert arch.kv_bytes_per_token(fp4=False) == 576 * 2
    # guided rows per token: qkv_a input, q_up, the latent, proj, fc1, fc2 of 8 routed + 1 shared experts
    assert arch.sites == ((1, 7168), (1, 1536), (1, 512), (1, 128 * 128), (1, 7168), (9, 2048))


def test_bad_configs_name_the_field():
    base = dict(vocab_size=32, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
                moe_intermediate_size=32, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="head_dim = qk_nope \\+ qk_rope"):
        ModelConfig(**base, head_dim=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16)
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        ModelConfig(**base, head_dim=16, n_group=3)
    with pytest.raises(ValueError, match="intermediate_size=0"):
        ModelConfig(**base, head_dim=16, first_k_dense_replace=1)
    with pytest.raises(ValueError, match="model_type='llama'"):
        from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks \\['n_routed_experts'\\]"):
        from_hf({k: v for k, v in tiny_deepseek().to_dict().items() if k != "n_routed_experts"})
