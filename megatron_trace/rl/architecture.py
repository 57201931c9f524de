"""What `trace-rl plan` needs to know of a model: parameter, FP4-site and KV-cache counts per
layer, for Qwen3-MoE (from its ModelConfig) and for the plan-only architectures (DeepSeek-V3)."""

from __future__ import annotations

from dataclasses import dataclass

from ..model_config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the plan needs of a model: Qwen3-MoE from its ModelConfig, or a plan-only one."""

    name: str
    vocab: int
    hidden: int
    layers: int
    attn_params: int  # per layer, all attention linears (FP4 sites)
    attn_out_width: int  # the attention output projection's input width (its FP4 site)
    q_heads: int
    kv_heads: int  # KV heads per token (rows of the k and v sites), TP shards them
    kv_width: int  # KV-cache elements per token per layer, K and V together
    norm_params: int  # per layer, norms (BF16)
    experts: int
    moe_ffn: int
    top_k: int
    shared_ffn: int = 0  # shared experts' intermediate size (0: none)
    dense_layers: int = 0  # leading layers with a dense FFN instead of experts
    dense_ffn: int = 0
    tie_embeddings: bool = False
    implemented: str = ""  # empty: trainable here; else why it is plan-only

    @classmethod
    def from_model_config(cls, name: str, c: ModelConfig) -> Architecture:
        """The plan's view of a Qwen3-MoE model: `name` and its ModelConfig."""
        d, nq, ng = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        return cls(name=name, vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_layers,
                   attn_params=c.hidden_size * d * (nq + 2 * ng) + nq * d * c.hidden_size, attn_out_width=nq * d,
                   q_heads=nq, kv_heads=ng, kv_width=2 * ng * d, norm_params=2 * c.hidden_size + 2 * d,
                   experts=c.num_experts, moe_ffn=c.moe_intermediate_size, top_k=c.top_k,
                   tie_embeddings=c.tie_word_embeddings)

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

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (MTP modules left out)."""
        per_layer = sum(self.attn_params + self.norm_params + sum(self.ffn_params(L)) for L in range(self.layers))
        router = self.moe_layers * self.experts * self.hidden
        return per_layer + router + self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden


def _mla(vocab, hidden, layers, heads, q_lora, kv_lora, nope, rope, v_dim) -> dict:
    """Multi-head latent attention's parameter and cache counts (DeepSeek-V2/V3)."""
    attn = (hidden * q_lora + q_lora * heads * (nope + rope) + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden)
    return dict(vocab=vocab, hidden=hidden, layers=layers, attn_params=attn, attn_out_width=heads * v_dim,
                q_heads=heads, kv_heads=1, kv_width=kv_lora + rope, norm_params=2 * hidden + q_lora + kv_lora)


# Plan-only architectures. DeepSeek-V3 (HF config.json of deepseek-ai/DeepSeek-V3): 61 layers, the
# first 3 dense (FFN 18432), 256 routed experts of 2048 plus 1 shared, top-8, MLA (128 heads,
# q_lora 1536, kv_lora 512, qk 128 + rope 64, v 128), vocab 129280; the MTP module is left out.
PLAN_ONLY = {
    "deepseek-v3": Architecture(
        name="deepseek-v3", **_mla(129280, 7168, 61, 128, 1536, 512, 128, 64, 128), experts=256, moe_ffn=2048,
        top_k=8, shared_ffn=2048, dense_layers=3, dense_ffn=18432,
        implemented="multi-head latent attention, shared experts and dense leading layers are not built yet"),
}
