"""The Megatron-core layer spec of a Qwen3-MoE-style GPT layer with TRACE's FP4 sites.

Local backend only (Transformer Engine is not required): GQA self-attention with QK RMSNorm
and RoPE, a top-k softmax router, routed experts without shared experts. The QKV and output
projections, each expert's fc1/fc2 and core attention's K/V are the FP4 sites of docs/design.md
section 3; norms, router, embeddings and the output head stay in high precision.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from .attention import FP4CoreAttention
from .experts import TraceGroupedMLP, TraceSequentialMLP
from .linear import FP4ColumnParallelLinear, FP4RowParallelLinear
from .moe import TraceMoELayer


class TraceRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm (float32 weight) that also runs under sequence parallelism.

    Megatron's local norm refuses sequence parallelism without Transformer Engine or Apex, yet
    MoE layers need it with tensor parallelism. The norm is pointwise over tokens, so it only
    has to mark its weight `sequence_parallel`: finalize_model_grads then all-reduces the
    weight's gradient over the tensor-parallel group (each rank saw other tokens, or for QK
    norms other heads).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class FP4SpecProvider(LocalSpecProvider):
    """Megatron's local backend with the FP4 linears and core attention."""

    def column_parallel_linear(self) -> type:
        return FP4ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return FP4RowParallelLinear

    def core_attention(self) -> type:
        return FP4CoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        experts = TraceGroupedMLP if moe_use_grouped_gemm else TraceSequentialMLP
        return partial(experts, submodules=MLPSubmodules(
            linear_fc1=FP4ColumnParallelLinear, linear_fc2=FP4RowParallelLinear, activation_func=None))


def trace_layer_spec(grouped_gemm: bool = False) -> ModuleSpec:
    """TransformerLayer spec: RMSNorm, QK-norm GQA attention, TRACE MoE layer whose experts run
    one after another (`grouped_gemm=False`) or as grouped GEMMs."""
    backend = FP4SpecProvider()
    norm = qk_norm = TraceRMSNorm
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_parallel_linear(),
                core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm,
        mlp=partial(TraceMoELayer, submodules=MoESubmodules(experts=backend.grouped_mlp_modules(grouped_gemm))),
        mlp_bda=get_bias_dropout_add,
    ))


def trace_block_spec(config: TransformerConfig, grouped_gemm: bool = False) -> TransformerBlockSubmodules:
    """The decoder of this pipeline stage: its layers and the final norm."""
    layer = trace_layer_spec(grouped_gemm)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=TraceRMSNorm)
