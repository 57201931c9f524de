"""TRACE's FP4 recipe as a Transformer Engine `CustomRecipe` factory (TE >= 2.19, pinned 2.20.2).

Megatron selects it by name: `fp4="e2m1"`, `fp4_recipe="custom"`,
`fp4_quantizer_factory="megatron_trace.te.recipe.trace_fp4_quantizer_factory"`.

On Hopper the quantized tensors are TE's `IdentityTensorStorage` holding TRACE's fake-quantized
values (FP4 grid values in the input's dtype): TE's GEMMs consume them in BF16, which is the
emulated FP4 math of TRACE's local spec, and TE's modules compute dgrad and wgrad from the
quantized operands as TRACE's straight-through estimator does. TE's quantize backward passes
every gradient, where TRACE's zeroes those of clipped elements; so TRACE's TE modules (te/spec.py)
quantize GEMM inputs themselves, with TRACE's backward, and the input slots pass them through
(`input_prequantized`). Weights keep TE's backward: with a weight's own amax only blocks whose
E4M3 scale underflows can clip.
On Blackwell they are TE's native `NVFP4TensorStorage` of the same codes and scales (written,
never run here: `TraceNVFP4Quantizer` says what is and is not covered).

Which site a quantizer serves (weight amax groups, guidance rows) is the `active_site` of the
module running (TRACE's TE modules, te/spec.py, set it around their forward); without one,
weights get one global scale over the local tensor and inputs one per row, unguided.
Tested on the CPU against TE's own classes, and inside TE's modules on an H200 with TE built
there (bench/gpu_te.sh; what passed and what is open: docs/notes/te-fp4-recipe.md).
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import NVFP4TensorStorage

from trace_kernels.fp4 import QTensor, fake_quantize

from ..guidance.codec import GuidanceFormatError
from ..megatron.qat import FP4Site, fake_quant_rows, quant_rows
from .nvfp4_storage import to_te_nvfp4
from .roles import Treatment, parse_role, treatment

TE_FLOAT4_E2M1 = DType.kFloat4E2M1

# The FP4 site of the TE module now running (set around its forward).
active_site: contextvars.ContextVar[FP4Site | None] = contextvars.ContextVar("trace_te_active_site", default=None)
# True while a TE linear runs on input rows TRACE has quantized already (the grouped experts' fc2:
# TraceTEGroupedMLP quantizes every expert's rows in one pass, not one quantizer call per expert).
input_prequantized: contextvars.ContextVar[bool] = contextvars.ContextVar("trace_te_input_prequantized",
                                                                          default=False)


class TraceNVFP4Quantizer(IdentityQuantizer):
    """A TE quantizer slot of TRACE's recipe: NVFP4 quantization of a weight (one global scale
    over the whole logical tensor) or of GEMM input rows (one global scale per row, the engine's
    guidance where the site has it), as the active site's local-spec math.

    Storage: TE's high-precision `IdentityTensorStorage` of the fake-quantized values (Hopper),
    or with `native` TE's `NVFP4TensorStorage` of the very codes and scales (Blackwell: cuBLAS
    runs the FP4 GEMM on them). The native path is written against TE 2.20.2's documented layout
    (nvfp4_storage.py, whose conversion is tested on the CPU) and has never run: no Blackwell GPU
    was available. It is taken only where both operands of a GEMM go native (an active site that
    quantizes its input); the experts' fc1, whose input arrives quantized per token, keeps the
    emulated path for both.

    `gemm`: in a grouped linear, the index of the GEMM (the local expert) this slot serves, set
    by the module (te/spec.py) once TE has built its quantizers; None in a plain linear.
    """

    def __init__(self, what: Treatment, *, native: bool = False, rowwise: bool = True,
                 columnwise: bool = True) -> None:
        if what not in (Treatment.FP4_WEIGHT, Treatment.FP4_INPUT):
            raise ValueError(f"TraceNVFP4Quantizer quantizes weights or inputs, not {what}")
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.what, self.native = what, native
        self.gemm: int | None = None

    def copy(self) -> TraceNVFP4Quantizer:
        q = TraceNVFP4Quantizer(self.what, native=self.native, rowwise=self.rowwise_usage,
                                columnwise=self.columnwise_usage)
        q.internal, q.optimize_for_gemm, q.gemm = self.internal, self.optimize_for_gemm, self.gemm
        return q

    def site(self) -> FP4Site | None:
        """The active site, narrowed to this slot's expert in a grouped linear's input."""
        site = active_site.get()
        if site is not None and site.all_experts and self.gemm is not None and self.what is Treatment.FP4_INPUT:
            site = site.for_expert(self.gemm)
        return site

    def goes_native(self, site: FP4Site | None) -> bool:
        return (self.native and site is not None and site.active and site.quantizes_input
                and not (self.what is Treatment.FP4_INPUT and input_prequantized.get()))

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (bf16/fp16/fp32) on the FP4 grid, same shape and dtype, no autograd edge.

        With an active site this is the local spec's math at that site (`FP4Site.quantize_weight`
        / `quantize_input`: its precision, weight amax group, guidance rows, observers); an
        expert's rows past the guidance's count are padding TE's grouped GEMM added, quantized
        unguided (zero rows stay zero). Inputs quantized upstream (`input_prequantized`) pass."""
        site = self.site()
        with torch.no_grad():
            x = x.detach()
            if self.what is Treatment.FP4_WEIGHT:
                if site is None:
                    return fake_quantize(x, "nvfp4", scale="tensor", check_finite=False)
                return site.quantize_weight(x)
            if input_prequantized.get():
                return x
            if site is None:
                return fake_quant_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape)
            x_RK = x.reshape(-1, x.shape[-1])
            n = _guided_rows(site, x_RK) if site.active and site.quantizes_input else None
            if n is None:  # (an inactive site, or one whose input arrives quantized, passes x through)
                return site.quantize_input(x)
            padding = fake_quant_rows(x_RK[n:], None, site.row_group)
            return torch.cat([site.quantize_input(x_RK[:n]), padding]).reshape(x.shape)

    def codes(self, x: torch.Tensor, site: FP4Site) -> QTensor:
        """The QTensor whose values `fake_quantize` gives at an active `site` that quantizes its
        input: a weight [N, K] per tensor, input rows [R, K] per row."""
        with torch.no_grad():
            if self.what is Treatment.FP4_WEIGHT:
                return site.weight_codes(x)
            x_RK = x.detach().reshape(-1, x.shape[-1])
            n = _guided_rows(site, x_RK)
            if n is None:
                return site.input_codes(x_RK)
            return cat_rows(site.input_codes(x_RK[:n]), quant_rows(x_RK[n:], None, site.row_group))

    def quantize_impl(self, tensor: torch.Tensor):
        site = self.site()
        if self.goes_native(site):
            return self.native_storage(self.codes(tensor, site))
        return super().quantize_impl(self.fake_quantize(tensor))

    def native_storage(self, q: QTensor) -> NVFP4TensorStorage:
        """q as TE's row-wise NVFP4 storage (compact scales: TE swizzles them for cuBLAS)."""
        if not self.internal:
            raise NotImplementedError("TRACE's native NVFP4 path holds internal storages (what TE's modules ask "
                                      "for); an FP4 primary weight (fp8_model_init) is not supported")
        f = to_te_nvfp4(q)
        return NVFP4TensorStorage(
            rowwise_data=f.rowwise_data, rowwise_scale_inv=f.rowwise_scale_inv, columnwise_data=None,
            columnwise_scale_inv=None, amax_rowwise=f.amax_rowwise, amax_columnwise=None,
            fp4_dtype=TE_FLOAT4_E2M1, quantizer=_layout(f.row_scaled_nvfp4), with_gemm_swizzled_scales=False,
            row_scaled_nvfp4=f.row_scaled_nvfp4)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: torch.Tensor | None = None):
        if isinstance(dst, NVFP4TensorStorage):  # a cached native weight, re-quantized in place
            fresh = self.native_storage(self.codes(src, self.site()))
            for name in ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise"):
                getattr(dst, name).copy_(getattr(fresh, name))
            return dst
        return super().update_quantized(self.fake_quantize(src), dst, noop_flag=noop_flag)

    def is_requantization_safe(self) -> bool:
        return False  # requantizing FP4 grid values with another scale moves them


@functools.cache
def _layout(row_scaled: bool) -> NVFP4Quantizer | None:
    """TE's own quantizer describing a row-wise storage's layout, built once per kind (it builds an
    RHT matrix on the current CUDA device); without a GPU (the CPU tests) None, which TE's
    storage class allows."""
    if not torch.cuda.is_available():
        return None
    return NVFP4Quantizer(rowwise=True, columnwise=False, row_scaled_nvfp4=row_scaled)


def _guided_rows(site: FP4Site, x_RK: torch.Tensor) -> int | None:
    """For an expert site, how many of x_RK's rows the guidance covers when TE's grouped GEMM
    padded them (None: no padding to leave out, or no guidance); GuidanceFormatError if the
    guidance has more rows than TE quantizes."""
    n = site.expert_guidance_rows()
    if n is None or n == x_RK.shape[0]:
        return None
    if n > x_RK.shape[0]:
        raise GuidanceFormatError(f"layer {site.layer} site {site.name} expert {site.expert}: guidance for "
                                  f"{n} rows, but TE's GEMM quantizes {x_RK.shape[0]}")
    return n


def cat_rows(a: QTensor, b: QTensor) -> QTensor:
    """Two row-scaled NVFP4 QTensors of rows [Ra, K] and [Rb, K] as one of [Ra + Rb, K]."""
    k = a.shape[-1]
    return QTensor(torch.cat([a.codes, b.codes]), torch.cat([a.block_scales, b.block_scales]),
                   torch.cat([a.global_scale, b.global_scale]), a.fmt, torch.Size([a.shape[0] + b.shape[0], k]))


def native_nvfp4_default() -> bool:
    """Whether the factory emits TE's native NVFP4 storage: $TRACE_TE_NATIVE_NVFP4 (1 / 0), else
    on a Blackwell GPU (compute capability 10.0 or newer, where cuBLAS has FP4 GEMMs)."""
    env = os.environ.get("TRACE_TE_NATIVE_NVFP4")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"TRACE_TE_NATIVE_NVFP4 must be 0 or 1, got {env!r}")
        return env == "1"
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def trace_fp4_quantizer_factory(role) -> IdentityQuantizer:
    """The `CustomRecipe` factory: a quantizer per TE slot (`role`: a TE 2.9-2.15 string, a 2.16+
    `QuantizerRole`, or None). Weights and GEMM inputs get TRACE's NVFP4 (native storage where
    `native_nvfp4_default()`), every other slot TE's high-precision `IdentityQuantizer`.

    The native path's backward must run on the dequantized forward operands, TRACE's
    straight-through estimator: NVTE_BACKWARD_OVERRIDE=dequantized (read by TE at import);
    ValueError otherwise."""
    what = treatment(parse_role(role))
    if what is Treatment.HIGH_PRECISION:
        return IdentityQuantizer()
    native = native_nvfp4_default()
    if native and os.environ.get("NVTE_BACKWARD_OVERRIDE") != "dequantized":
        raise ValueError("TRACE's native NVFP4 storage needs NVTE_BACKWARD_OVERRIDE=dequantized (backward GEMMs on "
                         "the dequantized FP4 operands, TRACE's straight-through estimator), set before TE is "
                         "imported; or TRACE_TE_NATIVE_NVFP4=0 for the emulated path")
    return TraceNVFP4Quantizer(what, native=native)
