"""A tiny random Qwen3-MoE built with `transformers` from a local config (no download), shaped
like the `tiny` preset, as an independent reference model and a source of real HF checkpoints."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_trace.checkpoint.hf_layout import hf_config, megatron_to_hf
from megatron_trace.model_config import PRESETS

CFG = PRESETS["tiny"]


def hf_tiny(seed: int = 0, dtype: torch.dtype = torch.float32):
    """(Qwen3MoeConfig, Qwen3MoeForCausalLM in eval mode) with random weights and non-trivial norms."""
    torch.manual_seed(seed)
    hf_cfg = Qwen3MoeConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, intermediate_size=128,
        moe_intermediate_size=CFG.moe_intermediate_size, num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_attention_heads, num_key_value_heads=CFG.num_key_value_heads,
        head_dim=CFG.head_dim, num_experts=CFG.num_experts, num_experts_per_tok=CFG.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=CFG.rope_theta, rms_norm_eps=CFG.rms_norm_eps,
        max_position_embeddings=CFG.max_position_embeddings, tie_word_embeddings=False, initializer_range=0.2)
    model = Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # give the norms non-trivial weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return hf_cfg, model.to(dtype)


def save_hf_tiny(path, seed: int = 0, max_shard_size: str = "200KB"):
    """Save `hf_tiny(seed)` in BF16 as a sharded HF checkpoint at `path`; returns the model."""
    _, model = hf_tiny(seed, torch.bfloat16)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


def packed(seqs):
    """input_ids [1, T], position_ids [1, T] restarting per sequence, cu_seq_lens_q int32 [n + 1]."""
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return torch.cat(seqs)[None], pos[None], cu


def hf_from_megatron(sd, tmp_path, dtype=torch.bfloat16):
    """transformers' own loader on an HF checkpoint written from the Megatron state dict."""
    save_file({k: v.contiguous() for k, v in megatron_to_hf(sd, CFG).items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(CFG)))
    return Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
