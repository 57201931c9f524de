"""What `trace-rl plan` needs to know of a model: parameter, FP4-site and KV-cache counts per
layer, from its ModelConfig (Qwen3-MoE, and the DeepSeek-V3 family that the plan sizes before
the trainer builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..model_config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the plan needs of a model (`from_model_config`)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    attn_params: int  # per layer, all attention linears (FP4 sites)
    attn_out_width: int  # the attention output projection's input width (its FP4 site)
    q_heads: int
    kv_heads: int  # KV heads per token (rows of the k and v sites), TP shards them
    kv_width: int  # KV-cache elements per token per layer, K and V together (MLA: the latent + rope key)
    kv_bf16_width: int = 0  # of those, kept BF16 in an FP4 cache (MLA's rope key, docs/design.md 3.1)
    kv_rows: int = 0  # FP4 cache rows per token per layer, a float32 global scale each (GQA: 2 x KV heads)
    sites: tuple[tuple[int, int], ...] = ()  # a MoE layer's FP4 activation sites: (rows per token, columns)
    norm_params: int  # per layer, norms and biases (BF16)
    experts: int
    moe_ffn: int
    top_k: int
    shared_ffn: int = 0  # shared experts' intermediate size (0: none)
    dense_layers: int = 0  # leading layers with a dense FFN instead of experts
    dense_ffn: int = 0
    tie_embeddings: bool = False
    num_params: int  # the whole model's (ModelConfig.num_params)
    implemented: str = ""  # empty: trainable here; else what the run's backends do not build (ModelConfig.unbuilt_in)

    @classmethod
    def from_model_config(cls, name: str, c: ModelConfig, part: str = "all") -> Architecture:
        """The plan's view of model `name` with ModelConfig `c`; `implemented` names what `part`
        (ModelConfig.unbuilt_in: "engine" for the Megatron trainer with the built-in engine) lacks."""
        h, d, nq, ng = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        experts = (c.top_k + c.n_shared_experts, c.moe_intermediate_size)  # fc2: a row per (token, expert)
        if c.mla:  # one latent (+ the shared rope key) per token serves every head
            kv = dict(attn_out_width=nq * c.v_head_dim, kv_heads=1, kv_width=c.kv_lora_rank + c.qk_rope_head_dim,
                      kv_bf16_width=c.qk_rope_head_dim, kv_rows=1)
            q_up = ((1, c.q_lora_rank),) if c.q_lora_rank else ()
            sites = ((1, h), *q_up, (1, c.kv_lora_rank), (1, nq * c.v_head_dim), (1, h), experts)
        else:
            kv = dict(attn_out_width=nq * d, kv_heads=ng, kv_width=2 * ng * d, kv_rows=2 * ng)
            sites = ((1, h), (1, nq * d), (1, h), experts, (ng, d), (ng, d))  # qkv, proj, fc1, fc2, k, v
        return cls(name=name, vocab=c.vocab_size, hidden=h, layers=c.num_layers,
                   attn_params=c.attention_linear_params, q_heads=nq, **kv, sites=sites,
                   norm_params=2 * h + c.attention_other_params, experts=c.num_experts,
                   moe_ffn=c.moe_intermediate_size, top_k=c.top_k, shared_ffn=c.shared_expert_size,
                   dense_layers=c.first_k_dense_replace, dense_ffn=c.intermediate_size,
                   tie_embeddings=c.tie_word_embeddings, num_params=c.num_params,
                   implemented=c.unbuilt_in(part))

    def kv_bytes_per_token(self, fp4: bool) -> float:
        """KV-cache bytes per token and layer: FP4 codes + E4M3 block scales + a float32 global scale
        per row (the BF16 part as BF16), or all BF16."""
        if not fp4:
            return 2 * self.kv_width
        quantized = self.kv_width - self.kv_bf16_width
        return quantized * (0.5 + 1 / 16) + 2 * self.kv_bf16_width + 4 * self.kv_rows

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def ffn_params(self, layer: int) -> tuple[int, int]:
        """(expert-parallel params, tensor-parallel params) of one layer's FFN (FP4 sites)."""
        if layer < self.dense_layers:
            return 0, 3 * self.hidden * self.dense_ffn
        return self.experts * 3 * self.hidden * self.moe_ffn, 3 * self.hidden * self.shared_ffn

    @property
    def fp4_params(self) -> int:
        """Parameters at FP4 sites: every attention and FFN linear."""
        return sum(self.attn_params + sum(self.ffn_params(L)) for L in range(self.layers))
