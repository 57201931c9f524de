"""Tiny DeepSeek-V3 and GLM-4.5 models built with `transformers` from local configs (no download):
independent references for the Megatron trainer's MLA, shared experts, dense leading layers and
sigmoid group-limited routing, and sources of real HF checkpoints."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

# DeepSeek-V3's YaRN in miniature (its release: factor 40 over 4096 positions, mscale = mscale_all_dim
# = 1); mscale_all_dim 0.8 here so that both YaRN scales (cos/sin and softmax) differ from 1
TINY_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def tiny_deepseek(**changes) -> DeepseekV3Config:
    """DeepSeek-V3's shape in miniature: MLA with a query latent and YaRN RoPE, one dense layer,
    8 routed experts in 4 groups (top-4 within 2 groups: Megatron's group score equals the
    reference's top-2 sum), one shared expert, scaled sigmoid gates."""
    return DeepseekV3Config(**{**dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=16, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, rope_parameters=dict(TINY_YARN),
        max_position_embeddings=512), **changes})


def tiny_glm(**changes) -> Glm4MoeConfig:
    """GLM-4.5's shape in miniature: GQA with q/k/v biases, q/k norm and half-rotary heads, one
    dense layer, 8 routed experts + 1 shared, scaled sigmoid gates."""
    return Glm4MoeConfig(**{**dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
        partial_rotary_factor=0.5, rope_theta=10000.0, max_position_embeddings=512), **changes})


def tiny_deepseek_direct_q(**changes) -> DeepseekV3Config:
    """tiny_deepseek with queries projected directly from the hidden state (q_lora_rank null, as
    DeepSeek-V2-Lite's attention has it): MLA's other query path."""
    return tiny_deepseek(**{"q_lora_rank": None, **changes})


FAMILIES = {"deepseek-v3": (tiny_deepseek, DeepseekV3ForCausalLM), "glm-4.5": (tiny_glm, Glm4MoeForCausalLM),
            "deepseek-v3-direct-q": (tiny_deepseek_direct_q, DeepseekV3ForCausalLM)}


def hf_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **changes):
    """(config, model in eval mode) of a tiny `family` model with random weights, non-trivial norms
    and a non-zero expert-bias correction (so that it changes which experts are picked)."""
    make_config, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    config = make_config(initializer_range=0.2, **changes)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return config, model.to(dtype)


def routed_experts(model, seqs) -> dict[int, torch.Tensor]:
    """{layer: int64 [T, top_k]}: the experts transformers' routers pick for each token of `seqs`
    (each sequence run on its own, tokens concatenated)."""
    picked: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            hooks.append(gate.register_forward_hook(
                lambda _m, _a, out, i=i: picked.setdefault(i, []).append(out[2].reshape(-1, out[2].shape[-1]))))
    try:
        with torch.no_grad():
            for s in seqs:
                model(s[None])
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v) for i, v in picked.items()}


def run_expert_bias_update(rank, *, cfg, sd, seqs):
    """One forward-backward of the trainer's Megatron DDP (float32) on `seqs` packed: each
    router's tokens per expert as counted in the forward, and its expert bias before and after
    Megatron's gradient finalisation (which applies the aux-loss-free balancing update)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.optimizer import TrainerOptimizer
    from megatron_trace.megatron.weights import global_name, load_full_state_dict
    from tests.support.scenarios import packed_inputs

    model = build_model(cfg, "bf16", params_dtype=torch.float32)
    load_full_state_dict(model, sd)
    model.train()
    opt = TrainerOptimizer(model, lr=1e-4)
    routers = {global_name(n, model): m for n, m in model.named_modules()
               if getattr(m, "expert_bias", None) is not None}
    before = {n: r.expert_bias.clone() for n, r in routers.items()}
    ids, pos, psp = packed_inputs(seqs)
    tokens = {}

    def fwd_step(data_iter, ddp):
        next(data_iter)
        out = ddp(ids, pos, None, packed_seq_params=psp)

        def loss_func(output):
            tokens.update({n: r.local_tokens_per_expert.clone() for n, r in routers.items()})
            return output.float().square().mean(), {}
        return out, loss_func

    get_forward_backward_func()(forward_step_func=fwd_step, data_iterator=iter([0]), model=[opt.ddp],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=1, forward_only=False)
    return {n: (tokens[n], before[n], r.expert_bias.clone()) for n, r in routers.items()}
