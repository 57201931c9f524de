"""Architecture of a Qwen3-MoE-style model, shared by the trainer and the engine.

Presets: `tiny` (tests), `demo` (the embedded default), `small` (CPU memory checks), `moe-0.4b` (the
one-GPU RL experiment), `qwen3-30b-a3b`, `qwen3-235b-a22b`. Field names follow the HF config's meaning;
`checkpoint.qwen3_moe.config_from_hf` reads one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Full-state-dict names of the weights at FP4 sites (docs/design.md section 3); the rest stay BF16.
FP4_WEIGHT_SITES = {"linear_qkv.weight": "qkv", "linear_proj.weight": "proj", "linear_fc1.weight": "fc1",
                    "linear_fc2.weight": "fc2"}  # suffix -> guidance site (guidance.record.SITES)
FP4_WEIGHT_SUFFIXES = tuple(FP4_WEIGHT_SITES)


def fp4_site_of(name: str) -> tuple[int, str] | None:
    """(layer, site) of a full weight name at an FP4 site, None for weights that stay BF16."""
    for suffix, site in FP4_WEIGHT_SITES.items():
        if name.endswith(suffix):
            return int(name.split(".")[2]), site
    return None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a Qwen3-MoE-style model (field names follow the HF config's meaning)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "head_dim", "moe_intermediate_size"):
            if getattr(self, name) % 16:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be a multiple of 16 (NVFP4 blocks)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("ModelConfig.num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"ModelConfig.top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model."""
        h, a = self.hidden_size, self.head_dim
        attn = h * a * (self.num_attention_heads + 2 * self.num_key_value_heads) + self.num_attention_heads * a * h
        experts = self.num_experts * 3 * h * self.moe_intermediate_size
        per_layer = attn + experts + self.num_experts * h + 2 * h + 2 * a
        return self.num_layers * per_layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h


def full_weight_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's full Megatron name (megatron/weights.py) and shape, in a fixed order."""
    h, d, nq, ng, f = (model_cfg.hidden_size, model_cfg.head_dim, model_cfg.num_attention_heads,
                       model_cfg.num_key_value_heads, model_cfg.moe_intermediate_size)
    shapes = {"embedding.word_embeddings.weight": (model_cfg.vocab_size, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (model_cfg.vocab_size, h)}
    for L in range(model_cfg.num_layers):
        p = f"decoder.layers.{L}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                   p + "self_attention.linear_qkv.weight": ((nq + 2 * ng) * d, h),
                   p + "self_attention.q_layernorm.weight": (d,), p + "self_attention.k_layernorm.weight": (d,),
                   p + "self_attention.linear_proj.weight": (h, nq * d),
                   p + "mlp.router.weight": (model_cfg.num_experts, h)}
        for e in range(model_cfg.num_experts):
            shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
            shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
    return shapes


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, moe_intermediate_size=32, num_experts=4, top_k=2, rope_theta=10000.0,
                        max_position_embeddings=512),
    # the embedded default: the built-in tasks' 20-token alphabet, a little wider than "tiny"
    "demo": ModelConfig(vocab_size=32, hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, moe_intermediate_size=64, num_experts=4, top_k=2, rope_theta=10000.0,
                        max_position_embeddings=512),
    # CPU-sized (28 M parameters, the demo's alphabet): memory and speed checks of whole runs
    "small": ModelConfig(vocab_size=32, hidden_size=512, num_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, moe_intermediate_size=256, num_experts=16, top_k=4, rope_theta=10000.0,
                         max_position_embeddings=512),
    # the headline RL experiment on one GPU (bench/rl_experiment.py): Qwen3-MoE-shaped (GQA with
    # head_dim 128, top-4 of 32 experts, 12 layers), 0.42 B parameters (73 M active per token), the
    # built-in tasks' character alphabet
    "moe-0.4b": ModelConfig(vocab_size=32, hidden_size=768, num_layers=12, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=128, moe_intermediate_size=448, num_experts=32,
                            top_k=4, rope_theta=10000.0, max_position_embeddings=1024),
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                                 top_k=8),
    "qwen3-235b-a22b": ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=94, num_attention_heads=64,
                                   num_key_value_heads=4, head_dim=128, moe_intermediate_size=1536, num_experts=128,
                                   top_k=8),
}
