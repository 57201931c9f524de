"""The Megatron-core layer spec of a Qwen3-MoE-style GPT layer with TRACE's FP4 sites.

Local backend only (Transformer Engine is not required): GQA self-attention with QK RMSNorm
and RoPE, a top-k softmax router, routed experts without shared experts. The QKV and output
projections, each expert's fc1/fc2 and core attention's K/V are the FP4 sites of DESIGN.md
section 3; norms, router, embeddings and the output head stay in high precision.
"""

from __future__ import annotations

from functools import partial


from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .attention import FP4CoreAttention
from .experts import TraceGroupedMLP, TraceSequentialMLP
from .linear import FP4ColumnParallelLinear, FP4RowParallelLinear
from .moe import TraceMoELayer


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
    norm = backend.layer_norm(rms_norm=True, for_qk=False, has_residual=True)
    qk_norm = backend.layer_norm(rms_norm=True, for_qk=True)
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
