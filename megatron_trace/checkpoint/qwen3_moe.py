"""HF Qwen3-MoE <-> full Megatron state dicts, and the model config from an HF config.

Full Megatron keys are those of a one-process `TraceGPTModel` (see megatron/weights.py). The
fused QKV weight interleaves query groups: for each KV head g, its query heads' rows, then its
key rows, then its value rows. An expert's fc1 weight is [gate; up], as HF's `gate_up_proj[e]`.
"""

from __future__ import annotations

import torch

from ..model_config import ModelConfig

_HF_FIELDS = {  # ModelConfig field -> HF config key
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "moe_intermediate_size": "moe_intermediate_size", "num_experts": "num_experts",
    "top_k": "num_experts_per_tok", "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
}


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from an HF Qwen3-MoE config.json dict. Raises ValueError naming an unsupported
    or missing field (dense layers, unnormalised top-k, shared experts)."""
    hf = dict(hf)
    # transformers 5 writes rope_parameters and num_local_experts; Qwen's config.json the older names
    if "rope_theta" not in hf and isinstance(hf.get("rope_parameters"), dict):
        hf["rope_theta"] = hf["rope_parameters"].get("rope_theta")
    hf.setdefault("num_experts", hf.get("num_local_experts"))
    missing = [k for k in _HF_FIELDS.values() if hf.get(k) is None and k != "tie_word_embeddings"]
    if missing:
        raise ValueError(f"HF config lacks {missing}")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("HF config has dense (mlp_only_layers / decoder_sparse_step) layers; TRACE models are all-MoE")
    if not hf.get("norm_topk_prob", True):
        raise ValueError("HF config has norm_topk_prob=false; TRACE's router renormalises the top-k weights")
    return ModelConfig(**{f: hf.get(k, False) if f == "tie_word_embeddings" else hf[k] for f, k in _HF_FIELDS.items()})


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE state dict -> full Megatron state dict (same tensors, fused/renamed)."""
    nq, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": hf["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]}
    for L in range(cfg.num_layers):
        h, m = f"model.layers.{L}.", f"decoder.layers.{L}."
        q = hf[h + "self_attn.q_proj.weight"].view(ng, nq // ng * d, -1)
        k = hf[h + "self_attn.k_proj.weight"].view(ng, d, -1)
        v = hf[h + "self_attn.v_proj.weight"].view(ng, d, -1)
        out |= {m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
                m + "self_attention.linear_qkv.weight": torch.cat([q, k, v], 1).reshape(-1, q.shape[-1]),
                m + "self_attention.q_layernorm.weight": hf[h + "self_attn.q_norm.weight"],
                m + "self_attention.k_layernorm.weight": hf[h + "self_attn.k_norm.weight"],
                m + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
                m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
                m + "mlp.router.weight": hf[h + "mlp.gate.weight"]}
        gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
        for e in range(cfg.num_experts):
            out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
            out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return out


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`."""
    nq, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for L in range(cfg.num_layers):
        h, m = f"model.layers.{L}.", f"decoder.layers.{L}."
        qkv = sd[m + "self_attention.linear_qkv.weight"].view(ng, (nq // ng + 2) * d, -1)
        q, k, v = qkv.split([nq // ng * d, d, d], dim=1)
        out |= {h + "input_layernorm.weight": sd[m + "input_layernorm.weight"],
                h + "self_attn.q_proj.weight": q.reshape(nq * d, -1), h + "self_attn.k_proj.weight": k.reshape(ng * d, -1),
                h + "self_attn.v_proj.weight": v.reshape(ng * d, -1),
                h + "self_attn.q_norm.weight": sd[m + "self_attention.q_layernorm.weight"],
                h + "self_attn.k_norm.weight": sd[m + "self_attention.k_layernorm.weight"],
                h + "self_attn.o_proj.weight": sd[m + "self_attention.linear_proj.weight"],
                h + "post_attention_layernorm.weight": sd[m + "pre_mlp_layernorm.weight"],
                h + "mlp.gate.weight": sd[m + "mlp.router.weight"],
                h + "mlp.experts.gate_up_proj": torch.stack(
                    [sd[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(cfg.num_experts)]),
                h + "mlp.experts.down_proj": torch.stack(
                    [sd[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(cfg.num_experts)])}
    return out
