"""The trainer's arithmetic in the Qwen3-MoE model SGLang builds, for every engine TRACE starts.

With guidance, the trainer makes every one of SGLang's FP4 rounding decisions, but SGLang's own
code computes the layer's high-precision operations in other orders than TRACE's trainer does,
and those differences reach the log-probabilities (k3_kl 1.6e-5 on the CPU, against ~1e-14
for the built-in engine, which runs TRACE's functions). After the model is loaded, this module
gives SGLang's modules the functions the built-in engine runs (trace_kernels), so both engines
compute what the trainer computes:

- RMSNorm (every norm): FP32 weights, as the trainer keeps them (SGLang holds them in BF16 and
  rounds the FP32 weights a weight update sends), and a fused residual added in BF16 first: the
  trainer's residual stream is BF16, and SGLang's fused add normalizes the FP32 sum instead;
- the attention's q/k norm and rotary embedding: per-head `rms_norm`, then `rope` with BF16
  cos/sin tables (SGLang rotates in FP32 from its own cache);
- the router: FP32 logits, the top k of them and the softmax over those k (SGLang: BF16 logits,
  softmax over every expert, renormalized), through SGLang's TopK so that its routed-experts
  capture and dispatch stay as they are;
- returned log-probabilities: log_softmax of the temperature-scaled FP32 logits (SGLang's
  sampler takes the log of its softmax unless deterministic inference is on: the flag is set on
  the sampler alone, where it picks log_softmax for the returned log-probabilities and nothing else).

Attention over TRACE's NVFP4 cache is the `trace_fp4` backend's (`attention.py`), which runs the
built-in engine's `cached_causal_attention` on the CPU.

SGLang's DeepSeek model (DeepSeek-V3 family) gets the same norms, and:
- MLA attention: TRACE's whole forward (`mla.py`);
- the router: FP32 logits; DeepSeek-V3's sigmoid scores with the expert bias picking within the
  best expert groups, gates normalised and scaled (`top_k_sigmoid_grouped`, the built-in engine's),
  as SGLang's custom routing function (SGLang's grouped top-k ignores one: it is turned off), so
  the routed-experts capture stays; the gates carry routed_scaling_factor, so SGLang's own
  multiply by it is made a multiply by 1;
- SwiGLU (the dense layers' and shared experts' act_fn): trace_kernels' silu_mul.
Other models are refused by name.
"""

from __future__ import annotations

import functools
import logging

import torch

from trace_kernels.fused_inputs import silu_mul
from trace_kernels.moe_routing import router_logits, top_k_sigmoid_grouped, top_k_softmax
from trace_kernels.norm_rope import rms_norm, rope, rope_inv_freq, rope_tables

from .quant import kernel_backend

logger = logging.getLogger(__name__)


def align_model(runner) -> None:
    """Give the model of SGLang's ModelRunner `runner` the trainer's arithmetic (module docstring)."""
    model = runner.model
    if type(model).__name__ in DEEPSEEK:
        _align_deepseek(model)
    elif type(model).__name__ == "Qwen3MoeForCausalLM":
        _align_qwen3(model)
    else:
        raise ValueError(f"trace: SGLang engines TRACE starts run Qwen3-MoE or the DeepSeek-V3 family, not "
                         f"{type(model).__name__}")
    runner.sampler.enable_deterministic = True  # returned log-probs from log_softmax (module docstring)


DEEPSEEK = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


def _align_qwen3(model) -> None:
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeSparseMoeBlock

    counts = {"norms": 0, "attention": 0, "routers": 0}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            _align_norm(module)
            counts["norms"] += 1
        elif isinstance(module, Qwen3MoeAttention):
            _align_attention(module)
            counts["attention"] += 1
        elif isinstance(module, Qwen3MoeSparseMoeBlock):
            _align_router(module)
            counts["routers"] += 1
    logger.info("trace: the trainer's arithmetic in %s", counts)


def _align_deepseek(model) -> None:
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA, DeepseekV2MLP, DeepseekV2MoE

    from .mla import align_attention
    from .weights import model_config_of

    cfg = model_config_of(model)
    counts = {"norms": 0, "attention": 0, "routers": 0, "swiglu": 0}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            _align_norm(module)
            counts["norms"] += 1
        elif isinstance(module, DeepseekV2AttentionMLA):
            align_attention(module, cfg)
            counts["attention"] += 1
        elif isinstance(module, DeepseekV2MoE):
            _align_sigmoid_router(module, cfg)
            counts["routers"] += 1
        elif isinstance(module, DeepseekV2MLP):
            module.act_fn = _SiluMul()
            counts["swiglu"] += 1
    if counts["attention"] != cfg.num_layers or counts["routers"] != cfg.num_layers - cfg.first_k_dense_replace:
        raise ValueError(f"trace: SGLang's DeepSeek model has {counts} for TRACE's {cfg.num_layers} layers, "
                         f"{cfg.first_k_dense_replace} dense")
    logger.info("trace: the trainer's arithmetic in %s", counts)


class _SiluMul(torch.nn.Module):
    """silu(gate) * up of [T, 2I] (gate | up), trace_kernels' (SGLang's SiluAndMul rounds otherwise)."""

    def forward(self, x):
        return silu_mul(x, backend=kernel_backend(x))


def _align_sigmoid_router(block, cfg) -> None:
    """FP32 router logits; DeepSeek-V3's grouped sigmoid top-k as SGLang's custom routing function."""
    if getattr(block, "num_fused_shared_experts", 0):
        raise ValueError("trace: SGLang fused the shared experts into the routed ones (start the engine with "
                         "disable_shared_experts_fusion): TRACE runs them as their own FFN, as the trainer does")
    gate = block.gate

    def logits(x, *args, **kwargs):
        return router_logits(x, gate.weight)

    gate.forward = logits
    config = block.topk.topk_config
    config.use_grouped_topk = False  # SGLang's grouped path ignores a custom routing function
    config.apply_routed_scaling_factor_on_output = False
    config.custom_routing_function = functools.partial(_top_k_sigmoid, gate, cfg)
    block.routed_scaling_factor = 1.0  # TRACE's gates carry it
    runner_config = getattr(block.experts, "moe_runner_config", None)
    if getattr(runner_config, "routed_scaling_factor", None) is not None:
        runner_config.routed_scaling_factor = 1.0


def _top_k_sigmoid(gate, cfg, hidden_states, gating_output, topk: int, renormalize: bool):
    """SGLang's custom routing function: (weights float32 [n, k], ids int32 [n, k]), the expert
    bias read live (weight updates change it)."""
    if topk != cfg.top_k or renormalize != cfg.norm_topk_prob:
        raise ValueError(f"trace: SGLang routes top-{topk} (renormalize={renormalize}), TRACE's model top-"
                         f"{cfg.top_k} (norm_topk_prob={cfg.norm_topk_prob})")
    top, weights = top_k_sigmoid_grouped(gating_output.float(), topk, gate.e_score_correction_bias.float(),
                                         n_group=cfg.n_group, topk_group=cfg.topk_group,
                                         scaling=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob)
    return weights, top.to(torch.int32)


def _align_norm(norm) -> None:
    """FP32 weight; forward(x, residual=None) -> rms_norm(x) or (rms_norm(residual + x), residual + x)."""
    if getattr(norm, "variance_size_override", None) is not None or not norm.has_weight:
        raise ValueError("trace: an RMSNorm with a partial variance or without a weight is not the trainer's")
    norm.weight.data = norm.weight.data.float()
    eps = norm.variance_epsilon

    def forward(x, residual=None, post_residual_addition=None):
        if post_residual_addition is not None:
            raise ValueError("trace: RMSNorm with a post-residual addition is not the trainer's")
        if residual is None:
            return rms_norm(x, norm.weight, eps, backend=kernel_backend(x))
        x = residual + x  # the BF16 residual stream, as the trainer adds a block's output
        return rms_norm(x, norm.weight, eps, backend=kernel_backend(x)), x

    norm.forward = forward


def _align_attention(attn) -> None:
    """q, k, v of the fused qkv: q and k RMS-normed per head, then rotated (the trainer's order)."""
    if getattr(attn.rotary_emb, "is_neox_style", True) is not True or type(attn.rotary_emb).__name__ != \
            "RotaryEmbedding":
        raise ValueError(f"trace: rotary embedding {type(attn.rotary_emb).__name__} is not the trainer's RoPE")
    inv_freq = rope_inv_freq(attn.rope_theta, attn.head_dim, attn.q_norm.weight.device)

    def apply_qk_norm_rope(qkv, positions, forward_batch):
        n, d = qkv.shape[0], attn.head_dim
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        backend = kernel_backend(qkv)
        q = rms_norm(q.reshape(n, -1, d), attn.q_norm.weight, attn.q_norm.variance_epsilon, backend=backend)
        k = rms_norm(k.reshape(n, -1, d), attn.k_norm.weight, attn.k_norm.variance_epsilon, backend=backend)
        cos, sin = rope_tables(positions.reshape(-1), inv_freq.to(qkv.device), qkv.dtype)
        return rope(q, cos, sin).reshape(n, -1), rope(k, cos, sin).reshape(n, -1), v

    attn.apply_qk_norm_rope = apply_qk_norm_rope
    attn.use_fused_qk_norm_rope = False


def _align_router(block) -> None:
    """FP32 router logits; the top k by logit and the softmax over them, through SGLang's TopK."""
    gate = block.gate

    def logits(x):
        return router_logits(x, gate.weight), None

    gate.forward = logits
    block.topk.topk_config.custom_routing_function = functools.partial(_top_k_softmax, block.layer_id)


def _top_k_softmax(layer: int, hidden_states, gating_output, topk: int, renormalize: bool):
    """SGLang's custom routing function: (weights float32 [n, k], ids int32 [n, k])."""
    if not renormalize:
        raise ValueError(f"trace: layer {layer}: the trainer's gates are the softmax over the top k (renormalized)")
    top, gate = top_k_softmax(gating_output.float(), topk)
    return gate, top.to(torch.int32)
