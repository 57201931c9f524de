"""TRACE's MoE GPT models (Qwen3-MoE, DeepSeek-V3, GLM-4.5) in Megatron-core with TRACE's FP4 sites.

`ModelConfig` (model_config.py) holds the architecture; `build_model` builds this rank's pipeline stage under
the current Megatron parallel state; `set_precision` switches every FP4 site between the trainer precisions
(modes.TrainerPrecision); `TraceGPTModel.forward` takes the micro-batch's guidance; `token_logprobs` gives
per-token log-probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from ..model_config import ModelConfig
from ..modes import TrainerPrecision
from . import context
from .attention import FP4CoreAttention
from .experts import GroupedExpertSites
from .mla import TraceMLASelfAttention
from .moe import TraceMoELayer
from .norm import LatentNorm
from .options import with_megatron_options
from .qat import FP4Site, Shard, SiteHolder
from .spec import LOCAL_LINEARS, Linears, trace_block_spec


def transformer_config(model_cfg: ModelConfig, *, dispatcher: str = "alltoall", recompute: str | None = None,
                       params_dtype: torch.dtype = torch.bfloat16, megatron_options: dict | None = None,
                       **overrides) -> TransformerConfig:
    """Megatron TransformerConfig for `model_cfg` under the current parallel state (an
    MLATransformerConfig for multi-head latent attention).

    dispatcher: "alltoall" or "allgather". recompute: None, "full" (every layer) or "selective"
    (the MoE layers). Sequence parallelism is on whenever tensor parallelism is. overrides:
    TRACE's own settings over these (a layer implementation's). megatron_options: the user's
    TransformerConfig settings (`trainer.megatron`); ValueError for one that TRACE sets here.
    """
    c = model_cfg
    c.require_built("the Megatron trainer", "megatron")
    tp = ps.get_tensor_model_parallel_world_size()
    heads = c.num_attention_heads if c.mla else c.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the {'attention' if c.mla else 'key/value'} "
                         f"heads ({heads})")
    rc = {}
    if recompute == "full":
        rc = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif recompute == "selective":
        rc = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    elif recompute is not None:
        raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
    sigmoid = c.scoring_func == "sigmoid"
    kw = dict(
        num_layers=c.num_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=heads, kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size or c.moe_intermediate_size, moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_layer_freq=[int(c.is_moe_layer(L)) for L in range(c.num_layers)],
        num_moe_experts=c.num_experts, moe_router_topk=c.top_k, moe_router_pre_softmax=False,
        moe_router_score_function=c.scoring_func, moe_router_enable_expert_bias=sigmoid,
        # DeepSeek-V3's bias update speed (its paper's gamma); Megatron applies it at each optimizer step
        moe_router_bias_update_rate=1e-3,
        moe_router_num_groups=c.n_group if c.n_group > 1 else None,
        moe_router_group_topk=c.topk_group if c.n_group > 1 else None,
        moe_router_topk_scaling_factor=c.routed_scaling_factor if c.routed_scaling_factor != 1 else None,
        moe_shared_expert_intermediate_size=c.shared_expert_size or None,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher,
        moe_enable_routing_replay=True, moe_router_dtype="fp32",
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, qk_layernorm=c.use_qk_norm or c.mla,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=c.attention_bias,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=tp > 1, attention_backend=AttnBackend.local, use_cpu_initialization=True,
        pipeline_dtype=params_dtype, init_method_std=0.02,
        gradient_accumulation_fusion=False, **rc,
        # pipeline stages exchange micro-batches of differing lengths (Megatron's allgather dispatcher cannot)
        variable_seq_lengths=ps.get_pipeline_model_parallel_world_size() > 1 and dispatcher == "alltoall",
    )
    kw.update(overrides)
    if c.mla:
        kw.update(multi_latent_attention=True, q_lora_rank=c.q_lora_rank or None, kv_lora_rank=c.kv_lora_rank,
                  qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                  rotary_base=c.rope_theta, **_mla_rope(c))
    kw = with_megatron_options(kw, megatron_options or {})
    return (MLATransformerConfig if c.mla else TransformerConfig)(**kw)


def _mla_rope(c: ModelConfig) -> dict:
    """MLATransformerConfig's RoPE settings: plain RoPE, or YaRN with the HF config's values (the
    softmax scale then carries Megatron's yarn mscale of mscale_all_dim, as transformers' does)."""
    if c.rope_type != "yarn":
        return dict(rope_type="rope", rotary_scaling_factor=1.0)  # 1.0: no YaRN softmax mscale
    return dict(rope_type="yarn", rotary_scaling_factor=c.rope_factor,
                original_max_position_embeddings=c.original_max_position_embeddings, beta_fast=c.beta_fast,
                beta_slow=c.beta_slow, mscale=c.mscale, mscale_all_dim=c.mscale_all_dim)


class TraceGPTModel(GPTModel):
    """GPTModel whose forward takes `guidance=` (a MicroBatchGuidance for this stage's layers)."""

    def forward(self, *args, guidance: context.MicroBatchGuidance | None = None, **kwargs):
        if guidance is not None and self.config.num_moe_experts:
            guidance.check_routed_experts(self.config.num_moe_experts)
        context.activate(guidance)
        try:
            out = super().forward(*args, **kwargs)
        except Exception:
            if guidance is not None:  # a bad input behind a deferred check may have caused this: named first
                guidance.raise_failed_checks()
            raise
        finally:
            context.activate(None)
        if guidance is not None:
            guidance.close_checks()  # the layers' deferred checks: read now, or at `checks_read_at_end`'s end
        if guidance is not None and torch.is_grad_enabled() and out.requires_grad:
            out = context.ActivateOnBackward.apply(out, guidance)
        return out


def build_model(model_cfg: ModelConfig, precision: TrainerPrecision | str = TrainerPrecision.BF16, *,
                grouped_gemm: bool = False, linears: Linears = LOCAL_LINEARS, **config_overrides) -> TraceGPTModel:
    """This rank's pipeline stage of the model, under the current Megatron parallel state.

    Args:
        cfg: architecture. precision: a TrainerPrecision ("bf16", "fp4-rne" or "fp4-guided").
        grouped_gemm: run the experts as grouped GEMMs (`torch._grouped_mm`, or TE's grouped
            linears) instead of in turn.
        linears: the linear modules (spec.LOCAL_LINEARS, or TE's: `megatron_trace.te.spec.te_linears()`).
        config_overrides: passed to `transformer_config` (dispatcher, recompute, params_dtype,
            megatron_options, or TransformerConfig fields).
    Returns:
        TraceGPTModel with every FP4 site attached (see `attach_sites`).
    """
    tcfg = transformer_config(model_cfg, **{**linears.config, **config_overrides})
    model = TraceGPTModel(
        config=tcfg, transformer_layer_spec=trace_block_spec(tcfg, grouped_gemm, linears),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="none", parallel_output=True,  # RoPE: in FP4CoreAttention (attention.py says why)
        rotary_base=int(model_cfg.rope_theta),  # unused by GPTModel here, but what checkpoints read back
    )
    model.model_cfg = model_cfg
    if not model_cfg.mla:  # MLA applies its decoupled RoPE itself
        model.rope = RotaryEmbedding(kv_channels=tcfg.kv_channels, rotary_percent=model_cfg.partial_rotary_factor,
                                     rotary_interleaved=tcfg.rotary_interleaved, rotary_base=int(model_cfg.rope_theta),
                                     use_cpu_initialization=tcfg.use_cpu_initialization)
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.rope = model.rope
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    attach_sites(model)
    set_precision(model, precision)
    return model


def attach_sites(model: torch.nn.Module) -> None:
    """Give every FP4 module its site: layer, rows and the groups its shards live on.

    Raises RuntimeError if an FP4-capable module is left without a site, so no layer can
    silently stay in high precision.
    """
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    tp = Shard(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = Shard(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    seq = tp if model.config.sequence_parallel else None
    for layer in model.decoder.layers:
        li = layer.layer_number - 1
        attn, mlp = layer.self_attention, layer.mlp
        if isinstance(attn, TraceMLASelfAttention):
            _attach_mla_sites(attn, li, tp_group, seq)
        else:
            attn.linear_qkv.fp4_site = FP4Site(name="qkv", layer=li, weight_group=tp_group, tokens=seq)
            attn.core_attention.k_site = FP4Site(name="k", layer=li, heads=tp)
            attn.core_attention.v_site = FP4Site(name="v", layer=li, heads=tp)
        attn.linear_proj.fp4_site = FP4Site(name="proj", layer=li, weight_group=tp_group, row_group=tp_group, cols=tp)
        if not isinstance(mlp, TraceMoELayer):  # a dense leading layer: token rows, tensor-parallel
            mlp.linear_fc1.fp4_site = FP4Site(name="fc1", layer=li, weight_group=tp_group, tokens=seq)
            mlp.linear_fc2.fp4_site = FP4Site(name="fc2", layer=li, weight_group=tp_group, row_group=tp_group, cols=tp)
            continue
        mlp.tokens = seq
        mlp.fc1_input = FP4Site(name="fc1", layer=li, tokens=seq)
        for e, expert in enumerate(getattr(mlp.experts, "local_experts", ())):  # TE's grouped experts: none
            expert.linear_fc1.fp4_site = FP4Site(name="fc1", layer=li, weight_group=etp_group, expert=e,
                                                 quantizes_input=False)
            expert.linear_fc2.fp4_site = FP4Site(name="fc2", layer=li, weight_group=etp_group, row_group=etp_group,
                                                 cols=etp, expert=e)
        if isinstance(mlp.experts, GroupedExpertSites):
            mlp.experts.fc1_site = FP4Site(name="fc1", layer=li, weight_group=etp_group, all_experts=True,
                                           quantizes_input=False)
            mlp.experts.fc2_site = FP4Site(name="fc2", layer=li, weight_group=etp_group, row_group=etp_group, cols=etp,
                                           all_experts=True)
        if mlp.shared_experts is not None:  # fc1 reads the routed experts' input row, with its guidance
            shared = mlp.shared_experts
            shared.linear_fc1.fp4_site = FP4Site(name="fc1", layer=li, weight_group=tp_group, tokens=seq)
            shared.linear_fc2.fp4_site = FP4Site(name="shared_fc2", layer=li, weight_group=tp_group,
                                                 row_group=tp_group, cols=tp)
    missing = [name for name, m in model.named_modules()
               if (isinstance(m, SiteHolder) and m.fp4_site is None)
               or (isinstance(m, FP4CoreAttention) and m.caches_kv and m.k_site is None)
               or (isinstance(m, TraceMLASelfAttention) and m.qkv_input is None)]
    if missing:
        raise RuntimeError(f"FP4 modules without a site (they would stay in BF16): {missing}")


def _attach_mla_sites(attn: TraceMLASelfAttention, li: int, tp_group, seq: Shard | None) -> None:
    """MLA's sites (mla.py): one `qkv` input quantization for the q/kv down projections, whose
    weights share a global scale; `q_up`, the latent `kv`, the KV up projection's weight."""
    attn.qkv_input = FP4Site(name="qkv", layer=li, tokens=seq)
    down = [m for m in (getattr(attn, "linear_q_down_proj", None), attn.linear_kv_down_proj) if m is not None]
    for m in down:
        m.fp4_site = FP4Site(name="qkv", layer=li, weight_group=tp_group, quantizes_input=False,
                             weight_peers=tuple(o.weight for o in down if o is not m))
    if hasattr(attn, "linear_q_up_proj"):
        attn.linear_q_up_proj.fp4_site = FP4Site(name="q_up", layer=li, weight_group=tp_group, tokens=seq)
    else:  # no query low-rank: the query projection reads the quantized hidden state
        attn.linear_q_proj.fp4_site = FP4Site(name="qkv", layer=li, weight_group=tp_group, quantizes_input=False)
    attn.kv_layernorm.fp4_site = FP4Site(name="kv", layer=li, tokens=seq)
    attn.linear_kv_up_proj.fp4_site = FP4Site(name="kv_up", layer=li, weight_group=tp_group, quantizes_input=False)
    attn.core_attention.caches_kv = False  # the engine caches the latent, not K and V


def fp4_sites(model: torch.nn.Module) -> list[FP4Site]:
    """Every FP4 site of the model (the audit's view of the trainer)."""
    sites = []
    for m in model.modules():
        if isinstance(m, SiteHolder) and not m.fp4_site.all_experts:  # TE's grouped linears: their experts'
            sites.append(m.fp4_site)
        elif isinstance(m, TraceMLASelfAttention):
            sites.append(m.qkv_input)
        elif isinstance(m, FP4CoreAttention) and m.caches_kv:
            sites += [m.k_site, m.v_site]
        elif isinstance(m, GroupedExpertSites):
            sites += [m.fc1_site, m.fc2_site]
        elif isinstance(m, TraceMoELayer):
            sites.append(m.fc1_input)
    return sites


KV_CACHE = "kv_cache"  # fp4_site_weights: what the KV cache's sites (K, V, MLA's latent) feed


def fp4_site_weights(model: torch.nn.Module) -> list[tuple[FP4Site, list[str]]]:
    """Every FP4 site of a one-process model with the full names of the weights it quantizes or
    whose input it is (KV_CACHE for K, V and MLA's latent): the audit's view, module by module."""
    c = model.model_cfg

    def experts(layer_prefix, fc):
        return [f"{layer_prefix}.experts.local_experts.{e}.linear_{fc}.weight" for e in range(c.num_experts)]
    out = []
    for name, m in model.named_modules():
        if isinstance(m, LatentNorm):
            out.append((m.fp4_site, [KV_CACHE]))
        elif isinstance(m, SiteHolder) and not m.fp4_site.all_experts:
            out.append((m.fp4_site, [name + ".weight"]))
        elif isinstance(m, TraceMLASelfAttention):
            down = ("linear_q_down_proj", "linear_kv_down_proj") if c.q_lora_rank else ("linear_q_proj",
                                                                                      "linear_kv_down_proj")
            out.append((m.qkv_input, [f"{name}.{d}.weight" for d in down]))
        elif isinstance(m, FP4CoreAttention) and m.caches_kv:
            out += [(m.k_site, [KV_CACHE]), (m.v_site, [KV_CACHE])]
        elif isinstance(m, GroupedExpertSites):
            layer = name.removesuffix(".experts")
            out += [(m.fc1_site, experts(layer, "fc1")), (m.fc2_site, experts(layer, "fc2"))]
        elif isinstance(m, TraceMoELayer):
            out.append((m.fc1_input, experts(name, "fc1")))
    return out


def set_precision(model: torch.nn.Module, precision: TrainerPrecision | str) -> None:
    """Switch every FP4 site (and the MoE layers' guidance dispatch) to `precision`."""
    precision = TrainerPrecision(precision)
    for site in fp4_sites(model):
        site.precision = precision
    for m in model.modules():
        if isinstance(m, TraceMoELayer):
            m.precision = precision  # its fc1_input site is among fp4_sites


def sequence_padding(num_tokens: int, multiple: int = 1) -> int:
    """Tokens to append so that sequence parallelism can split the micro-batch into parts of a
    multiple of `multiple` tokens each (`Linears.token_multiple`; 0 without TP when it is 1)."""
    return -num_tokens % (ps.get_tensor_model_parallel_world_size() * multiple)


def pack_sequences(seqs: list[torch.Tensor], device=None, pad: int = 0):
    """Sequences of token ids packed into one THD micro-batch, plus `pad` padding tokens at the
    end when pad > 0 (see `sequence_padding`).

    The padding copies the first sequence's first tokens (as sequences of their own, at the same
    positions), so its activations are that prefix's: the prefix's guidance rows fit it, and
    per-element statistics such as flip counts stay unbiased. Padding never carries a loss.

    Returns (input_ids int64 [1, T], position_ids int64 [1, T] restarting at each sequence,
    PackedSeqParams with cu_seqlens int32 [number of sequences + 1]).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    seqs = list(seqs)
    if pad:
        first = seqs[0]
        if len(first) == 0:
            raise ValueError("padding copies the first sequence, which is empty")
        seqs += [first] * (pad // len(first)) + ([first[: pad % len(first)]] if pad % len(first) else [])
    ids = torch.cat(seqs)[None].to(device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).int().to(device)
    longest = max(len(s) for s in seqs)
    return ids, pos, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest)


def token_logprobs(model: TraceGPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   targets: torch.Tensor, **forward_kwargs) -> torch.Tensor:
    """log p(targets[b, s] | input_ids[b, :s+1]) under the model, float32 [B, S].

    Uses Megatron's vocab-parallel cross entropy, so it is exact under tensor parallelism
    without gathering logits. Only on the last pipeline stage (others return their hidden
    states unchanged, as GPTModel does).
    """
    out = model(input_ids, position_ids, None, labels=targets, **forward_kwargs)
    return -out.float() if ps.is_pipeline_last_stage() else out
