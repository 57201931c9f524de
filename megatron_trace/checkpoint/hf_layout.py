"""HF checkpoints of the three families (Qwen3-MoE, DeepSeek-V3, GLM-4.5): the model config from an
HF config.json and back, and the HF <-> Megatron tensor mapping.

HF names are those of the checkpoints on disk (the Hub layout, which `transformers` writes with
`save_pretrained`): one `gate_proj` / `up_proj` / `down_proj` per expert, shared expert and dense
FFN. Megatron names are the full names of megatron/weights.py. Every Megatron tensor is made of the
rows of one or more HF tensors (`hf_parts`): the fused QKV weight (and GLM-4.5's QKV bias)
interleaves query groups (for each KV head g: its query heads' rows, then its key rows, then its
value rows), a gated FFN's fc1 weight is [gate; up]; MLA's projections keep HF's row order. The
mapping works on one tensor at a time, so conversions stream.
"""

from __future__ import annotations

import torch

from ..model_config import ModelConfig, from_hf, full_weight_shapes

_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "glm4_moe": "Glm4MoeForCausalLM"}


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from an HF config.json dict (`model_config.from_hf`), for conversion.

    Raises:
        ValueError: naming what the Megatron trainer does not build (RoPE scaling, unnormalised
            sigmoid gates, ...) or a value no TRACE model has (another activation, a sliding window).
    """
    cfg = from_hf(hf)
    cfg.require_built(f"converting this HF {cfg.model_type} checkpoint", "megatron")
    return cfg


def hf_config(model_cfg: ModelConfig) -> dict:
    """An HF config.json for a model that has none (trained from a preset): `from_hf` reads it back
    as `model_cfg`."""
    c = model_cfg
    out = {"architectures": [_ARCHITECTURES[c.model_type]], "model_type": c.model_type, "torch_dtype": "bfloat16",
           "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "moe_intermediate_size": c.moe_intermediate_size, "num_experts_per_tok": c.top_k,
           "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
           "norm_topk_prob": c.norm_topk_prob, "attention_bias": c.attention_bias}
    if c.rope_type == "yarn":
        out["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": c.rope_factor,
                               "original_max_position_embeddings": c.original_max_position_embeddings,
                               "beta_fast": c.beta_fast, "beta_slow": c.beta_slow, "mscale": c.mscale,
                               "mscale_all_dim": c.mscale_all_dim}
    if c.model_type == "qwen3_moe":
        return out | {"head_dim": c.head_dim, "num_experts": c.num_experts, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "intermediate_size": 4 * c.hidden_size, "use_sliding_window": False}
    out |= {"n_routed_experts": c.num_experts, "n_shared_experts": c.n_shared_experts,
            "routed_scaling_factor": c.routed_scaling_factor, "n_group": c.n_group, "topk_group": c.topk_group,
            "first_k_dense_replace": c.first_k_dense_replace,
            "intermediate_size": c.intermediate_size or 4 * c.hidden_size}
    if c.model_type == "deepseek_v3":
        return out | {"q_lora_rank": c.q_lora_rank or None, "kv_lora_rank": c.kv_lora_rank,
                      "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
                      "v_head_dim": c.v_head_dim, "rope_interleave": True,
                      # DeepSeek-V3's release has them and SGLang / vLLM read them; transformers' config lacks them
                      "topk_method": "noaux_tc", "scoring_func": c.scoring_func, "moe_layer_freq": 1}
    return out | {"head_dim": c.head_dim, "use_qk_norm": c.use_qk_norm,
                  "partial_rotary_factor": c.partial_rotary_factor}


def hf_dtype(hf: dict) -> torch.dtype:
    """The dtype an HF checkpoint stores its weights in (config.json's dtype / torch_dtype; BF16
    if neither). Megatron keeps norms in FP32; they go back in this dtype."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"HF config has dtype={name!r}, not a floating-point torch dtype")
    return dtype


_ATTENTION = {  # Megatron name under self_attention. -> HF name under self_attn.
    "q_layernorm.weight": "q_norm.weight", "k_layernorm.weight": "k_norm.weight", "linear_proj.weight": "o_proj.weight",
    "linear_q_proj.weight": "q_proj.weight", "linear_q_down_proj.weight": "q_a_proj.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight", "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight", "linear_kv_up_proj.weight": "kv_b_proj.weight"}
_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
          "pre_mlp_layernorm.weight": "post_attention_layernorm.weight", "mlp.router.weight": "mlp.gate.weight",
          "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype Megatron tensor `name` is written in to an HF checkpoint of `dtype`: the routers'
    expert-bias correction stays FP32 (DeepSeek-V3's release stores it so, and transformers keeps
    it in FP32: a 1e-3 update on a bias would round away in BF16)."""
    return torch.float32 if name.endswith(".mlp.router.expert_bias") else dtype


def hf_parts(name: str, model_cfg: ModelConfig) -> list[tuple[str, torch.Tensor | None]]:
    """The HF tensors that Megatron tensor `name` is made of, as (HF name, row indices into `name`
    as int64 [rows], or None for the whole tensor)."""
    c = model_cfg
    nq, ng, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    fixed = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight",
             "output_layer.weight": "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"}
    if name in fixed:
        return [(fixed[name], None)]
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise KeyError(f"no HF tensor for Megatron tensor {name!r}")
    h, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias") and not c.mla:
        kind = parts[-1]
        rows = torch.arange((nq + 2 * ng) * d).view(ng, nq // ng + 2, d)
        q, k, v = rows[:, :-2].reshape(-1), rows[:, -2].reshape(-1), rows[:, -1].reshape(-1)
        return [(h + f"self_attn.q_proj.{kind}", q), (h + f"self_attn.k_proj.{kind}", k),
                (h + f"self_attn.v_proj.{kind}", v)]
    if rest.endswith(("linear_fc1.weight", "linear_fc2.weight")):
        if rest.startswith("mlp.experts.local_experts."):
            ffn, f = f"{h}mlp.experts.{parts[6]}.", c.moe_intermediate_size
        elif rest.startswith("mlp.shared_experts."):
            ffn, f = f"{h}mlp.shared_experts.", c.shared_expert_size
        elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight") and not c.is_moe_layer(int(parts[2])):
            ffn, f = f"{h}mlp.", c.intermediate_size
        else:
            raise KeyError(f"no HF tensor for Megatron tensor {name!r}")
        if parts[-2] == "linear_fc1":
            return [(ffn + "gate_proj.weight", torch.arange(f)), (ffn + "up_proj.weight", torch.arange(f, 2 * f))]
        return [(ffn + "down_proj.weight", None)]
    attention = rest.removeprefix("self_attention.")
    if c.mla and attention == "q_layernorm.weight":  # the query latent's norm
        return [(h + "self_attn.q_a_layernorm.weight", None)]
    if rest.startswith("self_attention.") and attention in _ATTENTION:
        return [(h + "self_attn." + _ATTENTION[attention], None)]
    if rest in _LAYER:
        return [(h + _LAYER[rest], None)]
    raise KeyError(f"no HF tensor for Megatron tensor {name!r}")


def hf_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's name and shape under `cfg`."""
    out = {}
    for name, shape in full_weight_shapes(model_cfg).items():
        for hf_name, rows in hf_parts(name, model_cfg):
            out[hf_name] = shape if rows is None else (len(rows), *shape[1:])
    return out


def to_megatron(name: str, parts: list[torch.Tensor], model_cfg: ModelConfig) -> torch.Tensor:
    """Megatron tensor `name` from its HF parts (in the order of `hf_parts`)."""
    spec = hf_parts(name, model_cfg)
    if spec[0][1] is None:
        return parts[0]
    out = parts[0].new_empty(sum(len(rows) for _, rows in spec), *parts[0].shape[1:])
    for (_, rows), part in zip(spec, parts, strict=True):
        out[rows] = part
    return out


def to_hf(name: str, tensor: torch.Tensor, model_cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of Megatron tensor `name` (rows selected along dim 0; any tensor with the
    Megatron tensor's rows, e.g. packed FP4 codes or block scales, splits the same way)."""
    return [(hf_name, tensor if rows is None else tensor[rows]) for hf_name, rows in hf_parts(name, model_cfg)]


def hf_to_megatron(hf: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk layout) -> full Megatron state dict."""
    return {name: to_megatron(name, [hf[h] for h, _ in hf_parts(name, model_cfg)], model_cfg)
            for name in full_weight_shapes(model_cfg)}


def megatron_to_hf(sd: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron` (a tied output layer is not written)."""
    out = {}
    for name in full_weight_shapes(model_cfg):
        if name == "output_layer.weight" and model_cfg.tie_word_embeddings:
            continue
        out |= dict(to_hf(name, sd[name], model_cfg))
    return out
