"""FP4 QAT in transformers' Qwen3-MoE (`Qwen3MoeForCausalLM`), for the DeepSpeed trainer.

`attach_fp4_sites(model, precision)` gives every decoder layer TRACE's FP4 sites (docs/design.md
section 3), the Megatron trainer's `FP4Site`s with the same layers and names, so the shared
quantizer, the guidance rows and the audit's observers apply unchanged:
- qkv: the attention input, a row per token, and the Q, K and V weights under one global scale
  over the three together (Megatron's fused QKV weight: the same 16-element blocks, the same amax);
- k, v: K after RoPE and V, a row per (token, KV head), as the engine's KV cache stores them;
- proj: the attention output rows and o_proj's weight;
- fc1: the MoE input, a row per token quantized once before dispatch, and each expert's gate/up
  weight ([2I, H], one global scale per expert);
- fc2: the down projection's input, a row per (token, slot), and each expert's down weight.
The router stays in high precision, computed as the Megatron trainer and the engines compute it
(FP32 logits, softmax over the top k); when the micro-batch carries the engine's routed experts it
replays them (rollout routing replay), in every precision. Guidance and routed experts come from
the active `MicroBatchGuidance` (megatron_trace.megatron.context), as for the Megatron trainer.

Every RMSNorm computes as the Megatron trainer's (`fused_rms_norm`, the weight applied in
FP32), so that with the router and the packed attention the model's logits are the Megatron
trainer's to the bit on the same weights (tests/megatron_trace/deepspeed/test_model.py).

Samples are packed: a micro-batch is one row [1, T] of sequences one after another, with
`cu_seq_lens_q` (transformers' own keyword for packed sequences, int [n + 1]), position_ids
restarting at each sequence and use_cache=False. The tokens are then in the Megatron trainer's
THD order, so a micro-batch's guidance rows apply as they are, and attention runs on the Megatron
trainer's packed kernel (megatron_trace.packed_attention). Padded batches [B > 1, S] (and a KV
cache) keep transformers' attention in BF16 and are refused in FP4 modes.

The patch changes each module's class to a subclass that adds the sites; the Parameter objects
stay, so DeepSpeed (ZeRO-3 included) partitions them after this call, and each forward quantizes
its module's whole weights afresh: no cache across forwards, which would defeat ZeRO-3.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from trace_kernels.moe_routing import router_logits, top_k_softmax

from ..guidance.codec import GuidanceFormatError
from ..megatron import context
from ..megatron.norm import fused_rms_norm
from ..megatron.qat import FP4Site, fake_quant_expert_weights
from ..modes import TrainerPrecision
from ..packed_attention import packed_causal_attention

SITE_NAMES = ("qkv", "k", "v", "proj")  # the attention's; the experts' are fc1 and fc2


def _packed_bounds(hidden_states: torch.Tensor, kwargs: dict) -> list[int] | None:
    """The sequences' boundaries of a packed micro-batch [1, T, H] (a single sequence without
    cu_seq_lens_q), or None for a batch of several rows."""
    if hidden_states.shape[0] != 1:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return [0, hidden_states.shape[1]]
    cu = [int(c) for c in cu.tolist()]
    if cu[0] != 0 or cu[-1] != hidden_states.shape[1] or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seq_lens_q {cu} must rise from 0 to the micro-batch's {hidden_states.shape[1]} tokens")
    return cu


class TraceQwen3MoeRMSNorm(hf.Qwen3MoeRMSNorm):
    """RMSNorm as the Megatron trainer and TRACE's engines compute it (`fused_rms_norm`, one kernel
    each way on a GPU: the normalised BF16 input times the weight in FP32, rounded once;
    transformers rounds the normalised input to BF16 before the weight)."""

    def forward(self, hidden_states):
        if hidden_states.dtype != torch.bfloat16:
            return super().forward(hidden_states)
        return fused_rms_norm(hidden_states, self.weight.float(), self.variance_epsilon)


class FP4Qwen3MoeAttention(hf.Qwen3MoeAttention):
    """Qwen3-MoE attention with the qkv, k, v and proj FP4 sites (`fp4`), on packed sequences."""

    fp4: dict[str, FP4Site]

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        cu = _packed_bounds(hidden_states, kwargs)
        if cu is None or cache is not None:
            if self.fp4["qkv"].active:
                raise ValueError("FP4 training takes packed micro-batches [1, T] (cu_seq_lens_q) without a KV "
                                 f"cache (use_cache=False); got {tuple(hidden_states.shape[:2])}"
                                 f"{' with a cache' if cache is not None else ''}")
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        T, d = hidden_states.shape[1], self.head_dim
        qkv, proj = self.fp4["qkv"], self.fp4["proj"]
        x = qkv.quantize_input(hidden_states[0])  # [T, H]
        w = qkv.quantize_weight(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        q, k, v = F.linear(x, w).split([self.q_proj.out_features, self.k_proj.out_features,
                                        self.v_proj.out_features], dim=-1)
        q, k = self.q_norm(q.view(T, -1, d)), self.k_norm(k.view(T, -1, d))
        cos, sin = position_embeddings  # [1, T, d]
        q, k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [T, heads, d]
        k, v = self.fp4["k"].quantize_input(k), self.fp4["v"].quantize_input(v.view(T, -1, d))
        out = packed_causal_attention(q, k, v, cu, self.scaling)  # [T, heads * d]
        return F.linear(proj.quantize_input(out), proj.quantize_weight(self.o_proj.weight))[None], None


class FP4Qwen3MoeExperts(hf.Qwen3MoeExperts):
    """The fused experts with the fc1 and fc2 sites, in every precision: tokens sorted by expert
    (stable), as the Megatron trainer's dispatcher brings them to its experts, fc2's guidance rows
    with them; each expert's output times its gate in FP32, rounded, then summed per token."""

    fp4: dict[str, FP4Site]
    layer: int

    def forward(self, hidden_states, top_k_index, top_k_weights):
        fc1, fc2 = self.fp4["fc1"], self.fp4["fc2"]
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = context.expert_major_order(top_k_index)  # (token, slot) rows by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k
        w1, w2 = self.gate_up_proj, self.down_proj  # [E, 2I, H], [E, H, I]
        if fc1.active:
            w1, w2 = fake_quant_expert_weights(w1, fc1.weight_group), fake_quant_expert_weights(w2, fc2.weight_group)
        h = fc1.quantize_input(hidden_states)[token]  # [T * k, H]
        starts = [0, *accumulate(counts)]
        spans = [(e, starts[e], n) for e, n in enumerate(counts) if n]
        acts = []
        for e, start, n in spans:
            gate, up = F.linear(h[start:start + n], w1[e]).chunk(2, dim=-1)
            acts.append(self.act_fn(gate) * up)
        mb = context.active()
        if mb is not None:
            rg = mb.site(self.layer, "fc2")
            if rg is None:
                mb.expert_rows.pop(self.layer, None)
            else:  # fc2's rows come in (token, slot) order; the experts see them sorted
                mb.expert_rows[self.layer] = (rg.select_rows(order.to(rg.g.device)), counts)
        a = fc2.quantize_input(torch.cat(acts))  # [T * k, I]
        y = torch.cat([F.linear(a[start:start + n], w2[e]) for e, start, n in spans])
        y = y * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))


class TraceQwen3MoeTopKRouter(hf.Qwen3MoeTopKRouter):
    """The router as the Megatron trainer and TRACE's engines compute it (trace_kernels): FP32
    logits, the top k of them and the softmax over those k (transformers: BF16 logits, a softmax
    over every expert, renormalised; BF16 logits pick other experts for some tokens). When the
    micro-batch carries the engine's routed experts it replays them: the softmax over the
    trainer's logits at the engine's choices."""

    layer: int

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = router_logits(hidden_states, self.weight)  # float32 [n, E]
        mb = context.active()
        ids = None if mb is None else mb.routed_experts.get(self.layer)
        if ids is None:
            top, gate = top_k_softmax(logits, self.top_k)
            return logits, gate, top
        if tuple(ids.shape) != (hidden_states.shape[0], self.top_k):
            raise GuidanceFormatError(f"layer {self.layer}: routed experts {tuple(ids.shape)} for "
                                      f"{hidden_states.shape[0]} tokens and top-{self.top_k}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_experts:
            raise GuidanceFormatError(f"layer {self.layer}: routed expert ids outside 0..{self.num_experts - 1}")
        ids = ids.to(logits.device)
        return logits, torch.softmax(logits.gather(1, ids), dim=-1), ids


def attach_fp4_sites(model: torch.nn.Module, precision: TrainerPrecision | str = "bf16") -> torch.nn.Module:
    """Give every decoder layer of a transformers Qwen3-MoE model (`Qwen3MoeForCausalLM` or
    `Qwen3MoeModel`) its FP4 sites at `precision`, in place, keeping every Parameter object;
    returns the model. ValueError for a model it does not know (dense MLP layers included: TRACE's
    FP4 sites are the MoE experts')."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None or not all(isinstance(layer, hf.Qwen3MoeDecoderLayer) for layer in layers):
        raise ValueError(f"attach_fp4_sites needs transformers' Qwen3-MoE, got {type(model).__name__}")
    for i, layer in enumerate(layers):
        attn, moe = layer.self_attn, layer.mlp
        if not isinstance(moe, hf.Qwen3MoeSparseMoeBlock):
            raise ValueError(f"layer {i} has a dense MLP ({type(moe).__name__}): mlp_only_layers / "
                             "decoder_sparse_step are not supported")
        if not moe.gate.norm_topk_prob:
            raise ValueError("norm_topk_prob=False is not supported: TRACE's gates are the softmax over the top k")
        if attn.q_proj.bias is not None or attn.o_proj.bias is not None:
            raise ValueError("attention biases (attention_bias=True) are not supported")
        attn.__class__ = FP4Qwen3MoeAttention
        attn.fp4 = {name: FP4Site(name=name, layer=i) for name in SITE_NAMES}
        moe.experts.__class__ = FP4Qwen3MoeExperts
        moe.experts.layer = i
        moe.experts.fp4 = {"fc1": FP4Site(name="fc1", layer=i),
                           "fc2": FP4Site(name="fc2", layer=i, all_experts=True)}
        moe.gate.__class__ = TraceQwen3MoeTopKRouter
        moe.gate.layer = i
    for m in model.modules():
        if isinstance(m, hf.Qwen3MoeRMSNorm):
            m.__class__ = TraceQwen3MoeRMSNorm
    set_precision(model, precision)
    return model


def fp4_sites(model: torch.nn.Module) -> list[FP4Site]:
    """Every FP4 site of a model patched by attach_fp4_sites, layer by layer."""
    sites = []
    for m in model.modules():
        if isinstance(m, (FP4Qwen3MoeAttention, FP4Qwen3MoeExperts)):
            sites += m.fp4.values()
    return sites


def set_precision(model: torch.nn.Module, precision: TrainerPrecision | str) -> None:
    """Switch every FP4 site of the model to `precision` (bf16, fp4-rne or fp4-guided)."""
    precision = TrainerPrecision(precision)
    for site in fp4_sites(model):
        site.precision = precision
