"""The `trace_fp4` quantization method: TRACE's W4A4 at every FP4 site of SGLang's Qwen3-MoE.

The same math as the built-in engine (docs/design.md sections 2-3) through the one quantizer:
weights are NVFP4 with one global scale over the whole logical tensor (fused Q/K/V together,
each expert's gate and up together; under SGLang's tensor parallelism the amax is all-reduced
over the shard group first, so sharded and unsharded engines hold the same codes); each input
row is fake-quantized with its own global scale (a row-parallel input's amax all-reduced over
the ranks holding its other columns), then multiplied with the dequantized weights: on the CPU
through the torch reference, on a GPU through trace_kernels' FP4 GEMMs, which dequantize in
registers. The router gate, embeddings, norms and the head stay high precision.

In an engine TRACE started on dummy weights (then the trainer's: `PACKED_AT_START`) the packed
storage is allocated at `create_weights` and SGLang's BF16 weight stays empty, so the engine's
start never holds a BF16 shard (DeepSeek-V3 at TP8 would need 156 GiB per GPU); the weights
arrive packed or are packed on the way (`weights.load_trace_weights`), in place. Otherwise
(SGLang started with `quantization="trace_fp4"` on a BF16 checkpoint) weights load as BF16 through
SGLang's own loaders (sharding, Q/K/V and gate/up fusing) and `process_weights_after_loading`
packs them.
Shapes: T tokens of the forward, H hidden, K a linear's input width (this rank's part), N its
output width, E local experts, F 2 x their intermediate size (gate | up), k experts per token.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs
from torch.nn import Parameter

from trace_kernels.fp4 import Format, QTensor, dequantize, fake_quantize_rows, quantize
from trace_kernels.fp4.linear import fp4_grouped_linear, fp4_linear_parts, sum_parts
from trace_kernels.fused_inputs import silu_mul, silu_mul_fake_quantize_rows
from trace_kernels.moe_routing import combine_experts, expert_order

from . import capture
from .weight_payload import PACKED_AT_START

NAME = "trace_fp4"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# SGLang's linears at FP4 sites (module-name suffix -> (TRACE's site, its input rows recorded as
# guidance)), most specific first. Qwen3-MoE: qkv_proj, o_proj. DeepSeek-V3 family: the q and KV
# down projections (fused with a q latent; else q_proj and kv_a read the same input, recorded once),
# q_b (q_up), kv_b (kv_up: weight only, it reads the cached latent), o_proj, the dense layers' and
# shared experts' gate_up / down (the shared experts' input is the routed experts' fc1 row, recorded there)
LINEAR_SITES = (("shared_experts.gate_up_proj", "fc1", False), ("shared_experts.down_proj", "shared_fc2", True),
                ("self_attn.qkv_proj", "qkv", True), ("self_attn.fused_qkv_a_proj_with_mqa", "qkv", True),
                ("self_attn.kv_a_proj_with_mqa", "qkv", True), ("self_attn.q_proj", "qkv", False),
                ("self_attn.q_b_proj", "q_up", True), ("self_attn.kv_b_proj", "kv_up", False),
                ("self_attn.o_proj", "proj", True), ("mlp.gate_up_proj", "fc1", True), ("mlp.down_proj", "fc2", True))


def linear_site(prefix: str) -> tuple[str, bool] | None:
    """(TRACE's FP4 site, recorded) of SGLang's linear `prefix` ("model.layers.3.self_attn.o_proj"),
    None for a linear that stays high precision."""
    for suffix, site, recorded in LINEAR_SITES:
        if prefix.endswith("." + suffix):
            return site, recorded
    return None


def layer_index(prefix: str) -> int:
    """The decoder layer of a module's full name ("model.layers.3.self_attn.qkv_proj" -> 3)."""
    m = _LAYER.search(prefix)
    if m is None:
        raise ValueError(f"trace_fp4: cannot tell the decoder layer of module {prefix!r}")
    return int(m.group(1))


def kernel_backend(x: torch.Tensor) -> str:
    """trace_kernels' backend for a tensor: its GPU kernels on CUDA, the torch reference elsewhere
    (SGLang's CPU processes run no Triton interpreter)."""
    return "auto" if x.is_cuda else "torch"


def _group_of(layer: torch.nn.Module):
    """The process group holding the other shards of a tensor-parallel linear (None: not sharded)."""
    if getattr(layer, "tp_size", 1) <= 1:
        return None
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    for get in (get_attn_tp_group, get_tp_group):
        group = get()
        if group.world_size == layer.tp_size:
            return group.device_group
    raise RuntimeError(f"trace_fp4: no process group of {layer.tp_size} ranks holds this linear's shards")


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """t (float32), in place, maximised over `group` (None: unchanged)."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def quantize_input_rows(x_RK: torch.Tensor, group, keep: bool = False):
    """(NVFP4 fake quant of rows [R, K] with one global scale per row, in x's dtype; what a
    dense record keeps of the rounding, or None). With `group`, each row's amax is all-reduced
    over the ranks holding its other columns first, as the trainer's row-parallel sites do."""
    if group is None:
        return fake_quantize_rows(x_RK, capture=keep, backend=kernel_backend(x_RK))
    amax = all_reduce_max(x_RK.abs().amax(-1, keepdim=True).float(), group)
    q = quantize(x_RK, "nvfp4", scale="row", global_amax=amax, check_finite=False)
    return dequantize(q, x_RK.dtype), (q.rounding() if keep else None)


class TraceFP4Config(QuantizationConfig):
    """SGLang's quantization config for TRACE's FP4 policy (W4A4 here; the NVFP4 KV cache comes
    with it, `kv_cache.TraceNVFP4KVMethod`)."""

    @classmethod
    def get_name(cls) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # emulated FP4 (dequantize in registers, BF16 MMA): no FP4 tensor cores needed

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> TraceFP4Config:
        return cls()

    def get_scaled_act_names(self) -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        """TRACE's method for the attention linears and the fused experts; high precision for
        every other linear (the router gate)."""
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        if isinstance(layer, FusedMoE):
            return TraceFP4MoEMethod(layer_index(prefix))
        if isinstance(layer, LinearBase):
            site = linear_site(prefix)
            return TraceFP4LinearMethod(layer_index(prefix), *site) if site else UnquantizedLinearMethod()
        return None


class TraceFP4LinearMethod(LinearMethodBase):
    """A linear at FP4 site `site` of `layer`: NVFP4 weight, input rows fake-quantized (except
    kv_up's, the cached latent) and recorded as guidance when `recorded`. A layer with
    `trace_row_split` (row counts) runs its weight's row blocks as separate GEMMs (MLA's fused q
    and KV down projections, which the built-in engine and the trainer run apart)."""

    def __init__(self, layer: int, site: str, recorded: bool = True):
        self.layer, self.site, self.recorded = layer, site, recorded

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        """The BF16 weight [N, K] SGLang's loaders fill (this rank's shard), packed after loading; in
        an engine TRACE started, the packed weight itself (`packed_at_start`)."""
        if input_size_per_partition % 16:
            raise ValueError(f"trace_fp4: layer {self.layer} {self.site}: this rank's input width "
                             f"{input_size_per_partition} is not whole NVFP4 blocks of 16")
        n, k = sum(output_partition_sizes), input_size_per_partition
        if packed_at_start():
            layer.trace_weight = QTensor(*empty_packed((n, k)), Format.NVFP4, torch.Size((n, k)))
            n = k = 0
        weight = Parameter(torch.empty(n, k, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        layer.trace_site = (self.layer, self.site)

    def process_weights_after_loading(self, layer) -> None:
        """Pack the loaded BF16 weight: codes, E4M3 block scales and the global scale of the
        whole logical tensor (amax over every shard). Nothing to pack when it was created packed."""
        if not packed_at_start():
            pack_linear(layer, layer.weight.data)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]: x's rows fake-quantized, times the dequantized FP4 weight."""
        from sglang.srt.layers.linear import RowParallelLinear

        x_RK = x.reshape(-1, x.shape[-1])
        if self.site == "kv_up":
            xq = x_RK
        else:
            row_group = _group_of(layer) if isinstance(layer, RowParallelLinear) else None  # columns split
            keep = self.recorded and capture.wants(self.layer, self.site)
            xq, kept = quantize_input_rows(x_RK, row_group, keep)
            if keep:
                capture.record(self.layer, self.site, x_RK, kept)
        backend = kernel_backend(xq)
        split = getattr(layer, "trace_row_split", None)
        if split is None:
            y = sum_parts(fp4_linear_parts(xq, layer.trace_weight, backend=backend))
        else:
            y = torch.cat([sum_parts(fp4_linear_parts(xq, w, backend=backend))
                           for w in row_blocks(layer.trace_weight, split)], -1)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def packed_at_start() -> bool:
    """True in the processes of an engine TRACE started on dummy weights (`PACKED_AT_START`, set by the session):
    the trainer's weights arrive later, so FP4 sites are created packed and never hold BF16."""
    return os.environ.get(PACKED_AT_START) == "1"


def empty_packed(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A zero NVFP4 weight of logical `shape` [..., N, K] (K % 16 == 0) on the current default
    device: codes uint8 [..., N, K/2], E4M3 block scales [..., N, K/16] and the global scales
    float32 [...] (1: the codes stay zeros until the trainer's weights arrive)."""
    *lead, n, k = shape
    return (torch.zeros(*lead, n, k // 2, dtype=torch.uint8), torch.zeros(*lead, n, k // 16, dtype=torch.float8_e4m3fn),
            torch.ones(lead, dtype=torch.float32))


def row_blocks(q: QTensor, sizes) -> list[QTensor]:
    """A packed weight [N, K] as consecutive row blocks of `sizes` rows (sum N), the global scale shared."""
    out, start = [], 0
    for n in sizes:
        out.append(QTensor(q.codes[start:start + n], q.block_scales[start:start + n], q.global_scale, q.fmt,
                           torch.Size((n, q.shape[-1]))))
        start += n
    if start != q.shape[0]:
        raise ValueError(f"trace_fp4: row blocks {tuple(sizes)} of a weight of {q.shape[0]} rows")
    return out


def pack_linear(layer, w_NK: torch.Tensor, global_amax: torch.Tensor | None = None) -> None:
    """Quantize this rank's weight shard into layer.trace_weight (in place when it exists, so that
    CUDA graphs keep reading the same storage). global_amax: of the whole logical tensor, when
    the caller knows it; else all-reduced over the shard group."""
    if global_amax is None:
        global_amax = all_reduce_max(w_NK.abs().amax().float(), _group_of(layer))
    q = quantize(w_NK, "nvfp4", global_amax=global_amax.to(w_NK.device), check_finite=False)
    store_linear(layer, q)


def store_linear(layer, q: QTensor) -> None:
    """layer.trace_weight = q, copied into the existing storage when there is one."""
    old = getattr(layer, "trace_weight", None)
    if old is None:
        layer.trace_weight = q
        layer.weight.data = layer.weight.data.new_empty(0)  # only the packed weight stays
        return
    if old.codes.shape != q.codes.shape:
        raise ValueError(f"trace_fp4: a weight of shape {tuple(q.shape)} for a linear holding {tuple(old.shape)}")
    old.codes.copy_(q.codes)
    old.block_scales.copy_(q.block_scales)
    old.global_scale.copy_(q.global_scale)


@dataclass
class ExpertWeights:
    """A layer's local experts in FP4: codes uint8 [E, N, K/2], E4M3 block scales [E, N, K/16],
    one global scale per expert g float32 [E] (over the expert's whole logical tensor)."""

    codes: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor


class TraceFP4MoEMethod(FusedMoEMethodBase):
    """The fused experts of `layer`: gate/up (site fc1, input quantized per token) and down (site
    fc2, input quantized per (token, expert) row); the gate weight scales each expert's down
    output, as in the trainer."""

    def __init__(self, layer: int):
        self.layer = layer

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        """BF16 w13 [E, F, H] and w2 [E, H, F/2] for SGLang's expert loaders, packed after loading;
        in an engine TRACE started, the packed weights themselves (`packed_at_start`)."""
        if extra_weight_attrs.pop("with_bias", False):
            raise ValueError("trace_fp4: experts with biases are not TRACE's Qwen3-MoE")
        width = extra_weight_attrs.pop("moe_intermediate_size", None)
        trace_width = _trace_expert_width()
        if width is not None and trace_width is not None and width != trace_width:
            raise ValueError(f"trace_fp4: SGLang padded the experts' intermediate size {trace_width} to {width} (it "
                             f"keeps {width // getattr(layer, 'moe_tp_size', 1)} per moe-TP rank a multiple of 32); "
                             "TRACE's FP4 rows must be the trainer's: choose a tensor parallelism that needs no "
                             "padding")
        if hidden_size % 16 or intermediate_size_per_partition % 16:
            raise ValueError(f"trace_fp4: layer {self.layer}: expert widths {hidden_size} and "
                             f"{intermediate_size_per_partition} (this rank's) must be whole NVFP4 blocks of 16")
        for name, shape in (("w13", (num_experts, 2 * intermediate_size_per_partition, hidden_size)),
                            ("w2", (num_experts, hidden_size, intermediate_size_per_partition))):
            if packed_at_start():
                setattr(layer, f"trace_{name}", ExpertWeights(*empty_packed(shape)))
                shape = (0, 0, 0)
            weight = Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(f"{name}_weight", weight)
            set_weight_attrs(weight, extra_weight_attrs)

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        if moe_runner_config.activation != "silu" or moe_runner_config.apply_router_weight_on_input:
            raise ValueError("trace_fp4: the experts must be SwiGLU with the gate weight on the output")
        self.moe_runner_config = moe_runner_config

    def process_weights_after_loading(self, layer) -> None:
        """Pack both expert weights, each expert with the global scale of its whole tensor (nothing
        to pack when they were created packed)."""
        if packed_at_start():
            return
        for name in ("w13", "w2"):
            pack_experts(layer, name, getattr(layer, f"{name}_weight").data)

    def apply(self, layer, dispatch_output):
        """Every (token, expert) row through its expert as two grouped FP4 GEMMs (rows sorted by
        expert, tokens ascending within one), combined with the gate weights."""
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x_TH = dispatch_output.hidden_states
        gate_Tk, experts_Tk, _ = dispatch_output.topk_output
        t, k = experts_Tk.shape
        if getattr(layer, "moe_ep_size", 1) > 1:
            # SGLang's dispatcher marks other ranks' experts -1: those pairs run through local
            # expert 0 with gate 0 (exact zeros in the sum, static shapes for CUDA graphs); the
            # guidance merge takes each fc2 row from its expert's rank (capture.merge_ranks)
            local = experts_Tk >= 0
            experts_Tk, gate_Tk = torch.where(local, experts_Tk, 0), torch.where(local, gate_Tk, 0)
        backend = kernel_backend(x_TH)
        keep1, keep2 = capture.wants(self.layer, "fc1"), capture.wants(self.layer, "fc2")
        h_in, kept = quantize_input_rows(x_TH, None, keep1)
        if keep1:
            capture.record(self.layer, "fc1", x_TH, kept)
        tok_R, slot_R, pos_R, counts_E = expert_order(experts_Tk.long(), layer.trace_w13.codes.shape[0],
                                                      backend=backend)
        w13, w2 = layer.trace_w13, layer.trace_w2
        gate_up_RF = fp4_grouped_linear(h_in, w13.codes, w13.scales, w13.g, counts_E, x_rows=tok_R, backend=backend)
        row_group = _moe_tp_group(layer)  # the down projection's input columns split over moe-TP
        if row_group is None:  # SwiGLU and its rows' fake quant in one kernel, as the built-in engine runs them
            act_q, act, kept = silu_mul_fake_quantize_rows(gate_up_RF, capture=keep2, backend=backend)
        else:
            act = silu_mul(gate_up_RF, backend=backend)
            act_q, kept = quantize_input_rows(act, row_group, keep2)
        if keep2:  # the trainer's fc2 rows are (token, slot) pairs in token order
            capture.record(self.layer, "fc2", act, kept, order=(tok_R * k + slot_R))
        y_RH = fp4_grouped_linear(act_q, w2.codes, w2.scales, w2.g, counts_E, backend=backend)
        out = combine_experts(y_RH.to(x_TH.dtype), gate_Tk.float(), tok_R, slot_R, pos_R, backend=backend)
        return StandardCombineInput(hidden_states=out)


def _trace_expert_width() -> int | None:
    """The experts' intermediate size of TRACE's model config, when SGLangEngine started this engine."""
    import json
    import os

    from .weight_payload import MODEL_ENV

    spec = os.environ.get(MODEL_ENV)
    return json.loads(spec)["moe_intermediate_size"] if spec else None


def _moe_tp_group(layer):
    if getattr(layer, "moe_tp_size", 1) <= 1:
        return None
    from sglang.srt.distributed.parallel_state import get_moe_tp_group

    return get_moe_tp_group().device_group


def pack_experts(layer, name: str, w_ENK: torch.Tensor, global_amax_E: torch.Tensor | None = None) -> None:
    """Quantize the local experts' `name` ("w13" or "w2") weights [E, N, K] into layer.trace_<name>
    (in place when it exists), one global scale per expert over its whole logical tensor (the
    amax all-reduced over the moe-TP group, or given)."""
    e = w_ENK.shape[0]
    if global_amax_E is None:
        global_amax_E = all_reduce_max(w_ENK.abs().amax(dim=(1, 2)).float(), _moe_tp_group(layer))
    # a row per expert: its blocks of 16 are the blocks along K (K % 16 == 0)
    q = quantize(w_ENK.reshape(e, -1), "nvfp4", scale="row", global_amax=global_amax_E.reshape(e, 1).to(w_ENK.device),
                 check_finite=False)
    packed = ExpertWeights(q.codes.reshape(e, w_ENK.shape[1], -1), q.block_scales.reshape(e, w_ENK.shape[1], -1),
                           q.global_scale.reshape(e))
    old = getattr(layer, f"trace_{name}", None)
    if old is None:
        setattr(layer, f"trace_{name}", packed)
        weight = getattr(layer, f"{name}_weight")
        weight.data = weight.data.new_empty(0)  # only the packed weights stay
        return
    if old.codes.shape != packed.codes.shape:
        raise ValueError(f"trace_fp4: {name} of shape {tuple(w_ENK.shape)} for experts holding "
                         f"{tuple(old.codes.shape)} codes")
    old.codes.copy_(packed.codes)
    old.scales.copy_(packed.scales)
    old.g.copy_(packed.g)
