"""The RoPE a ModelConfig asks for, as the trainer computes it: inverse frequencies (YaRN's when
the config extends the context), the cos/sin scale and the attention's softmax scale. One setup
for the built-in engine (`model.py`) and SGLang's MLA forward (`sglang_rollout/sglang/mla.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_trace.model_config import ModelConfig
from trace_kernels.norm_rope import rope_inv_freq, rope_tables, yarn_inv_freq, yarn_mscale


@dataclass
class ModelRope:
    """inv_freq float32 [rot_dim/2]; scale: cos/sin's factor (YaRN's mscale ratio, else 1);
    softmax_scale: the attention's (YaRN: mscale_all_dim^2 / sqrt(head_dim); None: SDPA's 1/sqrt(head dim))."""

    inv_freq: torch.Tensor
    scale: float
    softmax_scale: float | None

    @classmethod
    def of(cls, cfg: ModelConfig, device) -> ModelRope:
        """The RoPE of `cfg` over the channels RoPE turns (`rotary_dim`); ValueError for a RoPE
        scaling the trainer does not compute (only YaRN, on MLA: ModelConfig.unbuilt_in)."""
        d = rotary_dim(cfg)
        if cfg.rope_type == "default":
            return cls(rope_inv_freq(cfg.rope_theta, d, device), 1.0, None)
        if cfg.rope_type != "yarn":
            raise ValueError(f"trace: {cfg.rope_type} RoPE scaling is not the trainer's")
        f = cfg.rope_factor
        return cls(yarn_inv_freq(cfg.rope_theta, d, f, cfg.original_max_position_embeddings, cfg.beta_fast,
                                 cfg.beta_slow, device),
                   yarn_mscale(f, cfg.mscale) / yarn_mscale(f, cfg.mscale_all_dim),
                   yarn_mscale(f, cfg.mscale_all_dim) ** 2 / cfg.head_dim ** 0.5)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, 1, rot_dim] in `dtype` at positions (int, any shape of n elements)."""
        return rope_tables(positions.reshape(-1), self.inv_freq.to(positions.device), dtype, self.scale)


def rotary_dim(cfg: ModelConfig) -> int:
    """The channels of each q/k head that RoPE turns: MLA's rope part, else the leading
    partial_rotary_factor of the head (GLM-4.5: half)."""
    return cfg.qk_rope_head_dim if cfg.mla else int(cfg.head_dim * cfg.partial_rotary_factor)
