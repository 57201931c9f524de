"""The Megatron-core layer specs of TRACE's MoE models, with TRACE's FP4 sites.

The linears come from a `Linears` set: `LOCAL_LINEARS` (Megatron's local backend with TRACE's
FP4 linears; Transformer Engine is not required) or TE's (`megatron_trace.te.spec`). Attention
is GQA with optional QK RMSNorm and QKV biases (Qwen3-MoE, GLM-4.5) or multi-head latent
attention (DeepSeek-V3, `mla.py`); the FFN is a MoE layer (top-k softmax or sigmoid router,
routed experts, optional shared experts) or, in the leading `first_k_dense_replace` layers, a
dense SwiGLU MLP. The linears, core attention's K/V and MLA's KV latent are the FP4 sites of
docs/design.md sections 3 and 3.1; norms, router, embeddings and the output head stay in high
precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from .attention import FP4CoreAttention
from .experts import TraceGroupedMLP, TraceSequentialMLP
from .linear import FP4ColumnParallelLinear, FP4RowParallelLinear
from .mla import TraceMLASelfAttention
from .moe import TraceMoELayer
from .norm import LatentNorm, TraceRMSNorm


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
        return partial(experts, submodules=_fp4_mlp(LOCAL_LINEARS))


@dataclass(frozen=True)
class Linears:
    """The FP4 linear modules a spec is built from: `column` and `row` parallel linears (each
    quantizing at its `fp4_site`) and `experts(grouped_gemm)`, the routed experts' builder."""

    name: str
    column: type
    row: type
    experts: Callable[[bool], object]
    mla: bool = True  # whether multi-head latent attention can be built from these linears
    config: dict = field(default_factory=dict)  # TransformerConfig settings they need (its transformer_impl)
    token_multiple: int = 1  # a micro-batch's token count must be a multiple of this (per sequence-parallel rank)


def _local_experts(grouped_gemm: bool):
    return FP4SpecProvider().grouped_mlp_modules(grouped_gemm)


LOCAL_LINEARS = Linears("local", FP4ColumnParallelLinear, FP4RowParallelLinear, _local_experts,
                        config={"transformer_impl": "local"})


def _fp4_mlp(linears: Linears) -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=linears.column, linear_fc2=linears.row, activation_func=None)


def _gqa_attention(config: TransformerConfig, linears: Linears) -> ModuleSpec:
    qk_norm = TraceRMSNorm if config.qk_layernorm else IdentityOp
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(
                          linear_qkv=linears.column, core_attention=FP4CoreAttention,
                          linear_proj=linears.row, q_layernorm=qk_norm, k_layernorm=qk_norm))


def _mla_attention(config: TransformerConfig) -> ModuleSpec:
    # Megatron accepts the down projections only as its own ColumnParallelLinear (an identity
    # check); TraceMLASelfAttention makes them FP4 linears once built.
    return ModuleSpec(module=TraceMLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=FP4ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                          linear_q_up_proj=FP4ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                          linear_kv_up_proj=FP4ColumnParallelLinear, core_attention=FP4CoreAttention,
                          linear_proj=FP4RowParallelLinear, kv_layernorm=LatentNorm,
                          q_layernorm=TraceRMSNorm if config.q_lora_rank else IdentityOp))  # the query latent's norm


def _moe(grouped_gemm: bool, shared_experts: bool, linears: Linears):
    shared = partial(SharedExpertMLP, submodules=_fp4_mlp(linears)) if shared_experts else None
    return partial(TraceMoELayer, submodules=MoESubmodules(experts=linears.experts(grouped_gemm),
                                                          shared_experts=shared))


def trace_layer_spec(config: TransformerConfig, moe: bool = True, grouped_gemm: bool = False,
                     linears: Linears = LOCAL_LINEARS) -> ModuleSpec:
    """TransformerLayer spec: RMSNorms, GQA or MLA attention (as `config` says), and a TRACE MoE
    layer whose experts run one after another (`grouped_gemm=False`) or as grouped GEMMs, or
    (`moe=False`) a dense SwiGLU MLP; its linears from `linears`."""
    if config.multi_latent_attention and not linears.mla:
        raise ValueError(f"multi-head latent attention (DeepSeek-V3) is built on the local spec only, not with "
                         f"the {linears.name} linears (trainer.transformer_impl=local)")
    attention = _mla_attention(config) if config.multi_latent_attention else _gqa_attention(config, linears)
    mlp = (_moe(grouped_gemm, bool(config.moe_shared_expert_intermediate_size), linears) if moe
           else partial(MLP.as_mlp_submodule, submodules=_fp4_mlp(linears)))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=TraceRMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=TraceRMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Whether each layer of the whole model (not just this stage) has experts."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


def trace_block_spec(config: TransformerConfig, grouped_gemm: bool = False,
                     linears: Linears = LOCAL_LINEARS) -> TransformerBlockSubmodules:
    """The decoder of this pipeline stage: its layers (dense or MoE, by `config.moe_layer_freq`)
    and the final norm."""
    offset, count = get_transformer_layer_offset(config), get_num_layers_to_build(config)
    specs = {moe: trace_layer_spec(config, moe, grouped_gemm, linears) for moe in (False, True)}
    layers = [specs[moe] for moe in moe_layer_pattern(config)[offset: offset + count]]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TraceRMSNorm)
