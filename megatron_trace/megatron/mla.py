"""Megatron's multi-head latent attention (DeepSeek-V2/V3) with TRACE's FP4 sites.

The sites (docs/design.md section 3.1): the query and KV down projections read the same normed
hidden state and form one `qkv` site (`qkv_input` quantizes it once for both; their weights share
one global scale, `FP4Site.weight_peers`, as the engine's fused `q_a` + `kv_a` GEMM has one); the query up
projection is the `q_up` site; the compressed KV latent, after its norm, is the `kv` site
(`norm.LatentNorm`), what the engine's cache stores; the KV up projection quantizes its weight
only, reading the latent as the cache holds it; the output projection is `proj`. The decoupled
RoPE key stays BF16. RoPE, the up projections and the attention are Megatron's own.
"""

from __future__ import annotations

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from .linear import FP4ColumnParallelLinear
from .qat import FP4Site


class TraceMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose down projections are FP4 linears reading one quantized input (sites
    set by `attach_sites`)."""

    qkv_input: FP4Site | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Megatron builds them only as its own ColumnParallelLinear (it checks the class by
        # identity); the FP4 subclass adds no state, only its `_forward_impl` hook.
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            if hasattr(self, name):
                getattr(self, name).__class__ = FP4ColumnParallelLinear

    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None:
            return super()._resolve_qk_norm_config(submodules)
        # Without a query latent, Megatron 0.19.2 swaps the query projection for the backend's fused
        # norm + linear whenever qk_layernorm is on; DeepSeek's direct query projection has no norm
        # (qk_layernorm is on for the KV latent's), so the spec's FP4 linear is kept as it is.
        return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp, q_layernorm=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, kv_layernorm=submodules.kv_layernorm)

    def _qkv_down_projection(self, hidden_states):
        # both down projections (or, without a query latent, the query projection) read this row
        if self.qkv_input is not None:
            hidden_states = self.qkv_input.quantize_input(hidden_states)
        return super()._qkv_down_projection(hidden_states)
