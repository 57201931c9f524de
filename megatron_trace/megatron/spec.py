"""The Megatron-core layer spec of a Qwen3-MoE-style GPT layer with TRACE's FP4 sites.

Local backend only (Transformer Engine is not required): GQA self-attention with QK RMSNorm
and RoPE, a top-k softmax router, routed experts without shared experts. The QKV and output
projections, each expert's fc1/fc2 and core attention's K/V are the FP4 sites of DESIGN.md
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
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .attention import FP4CoreAttention
from .linear import FP4ColumnParallelLinear, FP4RowParallelLinear
from .moe import TraceMoELayer


class TraceSequentialMLP(SequentialMLP):
    """Megatron's SequentialMLP, except that the gate weight multiplies each expert's output.

    Megatron scales the fc1 activation by the gate weight before fc2; SGLang's and vLLM's
    fused MoE kernels scale the fc2 output. With per-row FP4 scales the two give different fc2
    inputs, so the trainer follows the engines: the fc2 site quantizes act(gate) * up.
    """

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        chunks = torch.split(permuted_local_hidden_states, tokens_per_expert.tolist())
        out = torch.cat([expert(chunk)[0] for expert, chunk in zip(self.local_experts, chunks)])
        return (out * permuted_probs.unsqueeze(-1)).to(out.dtype), None


class FP4SpecProvider(LocalSpecProvider):
    """Megatron's local backend with the FP4 linears and core attention."""

    def column_parallel_linear(self) -> type:
        return FP4ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return FP4RowParallelLinear

    def core_attention(self) -> type:
        return FP4CoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        if moe_use_grouped_gemm:
            raise NotImplementedError("the grouped-GEMM experts are selected by build_model(grouped_gemm=True)")
        return partial(TraceSequentialMLP, submodules=MLPSubmodules(
            linear_fc1=FP4ColumnParallelLinear, linear_fc2=FP4RowParallelLinear, activation_func=None))


def trace_layer_spec() -> ModuleSpec:
    """TransformerLayer spec: RMSNorm, QK-norm GQA attention, TRACE MoE layer."""
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
        mlp=partial(TraceMoELayer, submodules=MoESubmodules(experts=backend.grouped_mlp_modules(False))),
        mlp_bda=get_bias_dropout_add,
    ))
