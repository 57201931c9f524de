"""Qwen3-MoE: the model config from an HF config.json, and the HF <-> Megatron tensor mapping.

HF names are those of the checkpoints on disk (the Hub layout, which `transformers` writes with
`save_pretrained`): one `gate_proj` / `up_proj` / `down_proj` per expert. Megatron names are the
full names of megatron/weights.py. Every Megatron tensor is made of the rows of one or more HF
tensors (`hf_parts`): the fused QKV weight interleaves query groups (for each KV head g: its query
heads' rows, then its key rows, then its value rows) and an expert's fc1 weight is [gate; up].
The mapping works on one tensor at a time, so conversions stream.
"""

from __future__ import annotations

import torch

from ..model_config import ModelConfig, from_hf, full_weight_shapes

_HF_FIELDS = {  # ModelConfig field -> HF config key
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "moe_intermediate_size": "moe_intermediate_size", "num_experts": "num_experts",
    "top_k": "num_experts_per_tok", "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
}


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from an HF Qwen3-MoE config.json dict (`model_config.from_hf`), for conversion.

    Raises:
        ValueError: naming what TRACE does not implement (another family, unnormalised top-k,
            attention bias, RoPE scaling, dense layers, another activation, sliding window).
    """
    cfg = from_hf(hf)
    if cfg.model_type != "qwen3_moe":
        raise ValueError(f"HF config model_type={cfg.model_type!r}: TRACE converts only qwen3_moe checkpoints "
                         f"today ({cfg.unbuilt})")
    if cfg.unbuilt:
        raise ValueError(f"HF config of this Qwen3-MoE model: {cfg.unbuilt}")
    return cfg


def hf_config(model_cfg: ModelConfig) -> dict:
    """An HF config.json for a model that has none (trained from a preset)."""
    out = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
           "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": 4 * model_cfg.hidden_size,
           "use_sliding_window": False, "initializer_range": 0.02, "use_cache": True}
    return out | {k: getattr(model_cfg, f) for f, k in _HF_FIELDS.items()}


def hf_dtype(hf: dict) -> torch.dtype:
    """The dtype an HF checkpoint stores its weights in (config.json's dtype / torch_dtype; BF16
    if neither). Megatron keeps norms in FP32; they go back in this dtype."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"HF config has dtype={name!r}, not a floating-point torch dtype")
    return dtype


def hf_parts(name: str, model_cfg: ModelConfig) -> list[tuple[str, torch.Tensor | None]]:
    """The HF tensors that Megatron tensor `name` is made of, as (HF name, row indices into `name`
    as int64 [rows], or None for the whole tensor)."""
    nq, ng, d, f = (model_cfg.num_attention_heads, model_cfg.num_key_value_heads, model_cfg.head_dim,
                    model_cfg.moe_intermediate_size)
    fixed = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight",
             "output_layer.weight": "model.embed_tokens.weight" if model_cfg.tie_word_embeddings else "lm_head.weight"}
    if name in fixed:
        return [(fixed[name], None)]
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise KeyError(f"no HF tensor for Megatron tensor {name!r}")
    h, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
    if rest == "self_attention.linear_qkv.weight":
        rows = torch.arange((nq + 2 * ng) * d).view(ng, nq // ng + 2, d)
        q, k, v = rows[:, :-2].reshape(-1), rows[:, -2].reshape(-1), rows[:, -1].reshape(-1)
        return [(h + "self_attn.q_proj.weight", q), (h + "self_attn.k_proj.weight", k),
                (h + "self_attn.v_proj.weight", v)]
    if rest.startswith("mlp.experts.local_experts."):
        e, linear = parts[6], parts[7]
        x = f"{h}mlp.experts.{e}."
        if linear == "linear_fc1":
            return [(x + "gate_proj.weight", torch.arange(f)), (x + "up_proj.weight", torch.arange(f, 2 * f))]
        if linear == "linear_fc2":
            return [(x + "down_proj.weight", None)]
    renames = {"input_layernorm.weight": "input_layernorm.weight",
               "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
               "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
               "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
               "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
               "mlp.router.weight": "mlp.gate.weight"}
    if rest not in renames:
        raise KeyError(f"no HF tensor for Megatron tensor {name!r}")
    return [(h + renames[rest], None)]


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
    """HF Qwen3-MoE state dict (on-disk layout) -> full Megatron state dict."""
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
