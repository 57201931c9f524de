"""The engine's model math against transformers' own Qwen3-MoE (a tiny random config built
locally, no download), and the HF <-> Megatron state-dict mapping."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_trace.checkpoint.qwen3_moe import (
    config_from_hf,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_trace.model_config import PRESETS
from sglang_rollout.engine import EngineConfig, TraceEngine

CFG = PRESETS["tiny"]


def hf_tiny(seed=0):
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
    return hf_cfg, model


def test_config_and_state_dict_map_both_ways():
    hf_cfg, model = hf_tiny()
    assert config_from_hf(hf_cfg.to_dict()) == CFG
    hf_sd = model.state_dict()
    back = megatron_to_hf(hf_to_megatron(hf_sd, CFG), CFG)
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_engine_bf16_matches_transformers_qwen3_moe():
    hf_cfg, model = hf_tiny()
    model = model.to(torch.bfloat16)
    sd = hf_to_megatron({k: v.clone() for k, v in model.state_dict().items()}, CFG)
    engine = TraceEngine(CFG, EngineConfig(precision="bf16", block_size=8, num_blocks=16))
    engine.update_weights(sd, 0)
    g = torch.Generator().manual_seed(1)
    for n in (5, 33):
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g)
        with torch.no_grad():
            hf_logits = model(tokens[None]).logits[0].float()
        want = torch.log_softmax(hf_logits[:-1], -1).gather(1, tokens[1:, None])[:, 0]
        got = engine.score(tokens.tolist())
        # both in bf16 with different op orders (e.g. HF's router logits are bf16, ours fp32)
        torch.testing.assert_close(got, want, atol=0.08, rtol=0.02)
