"""TRACE's FP4 recipe as a Transformer Engine `CustomRecipe` factory (TE >= 2.19, pinned 2.20.2).

Megatron selects it by name: `fp4="e2m1"`, `fp4_recipe="custom"`,
`fp4_quantizer_factory="megatron_trace.te.recipe.trace_fp4_quantizer_factory"`.

On Hopper the quantized tensors are TE's `IdentityTensorStorage` holding TRACE's fake-quantized
values (FP4 grid values in the input's dtype): TE's GEMMs consume them in BF16, which is the
emulated FP4 math of TRACE's local spec, and TE's modules compute dgrad and wgrad from the
quantized operands as TRACE's straight-through estimator does. One difference: TE's quantize
backward passes every gradient, where TRACE's zeroes those of elements clipped by a guided scale.

Which site a quantizer serves (weight amax groups, guidance rows) is the `active_site` of the
module running; without one, weights get one global scale over the local tensor and inputs one
per row, unguided.
Not yet run inside TE's modules: that needs TE's extension, built on a GPU machine
(docs/notes/te-fp4-recipe.md); the quantizers are tested on the CPU against TE's own classes.
"""

from __future__ import annotations

import contextvars

import torch
from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer

from trace_kernels.fp4 import fake_quantize

from ..megatron.qat import FP4Site, fake_quant_rows
from ..modes import TrainerPrecision
from .roles import Treatment, parse_role, treatment

# The FP4 site of the TE module now running (set around its forward).
active_site: contextvars.ContextVar[FP4Site | None] = contextvars.ContextVar("trace_te_active_site", default=None)


class TraceNVFP4Quantizer(IdentityQuantizer):
    """A TE quantizer slot of TRACE's recipe: NVFP4 fake quantization of a weight (one global
    scale over the whole logical tensor) or of GEMM input rows (one global scale per row, the
    engine's guidance where the site has it). Holds the result as TE's high-precision storage."""

    def __init__(self, what: Treatment, *, rowwise: bool = True, columnwise: bool = True) -> None:
        if what not in (Treatment.FP4_WEIGHT, Treatment.FP4_INPUT):
            raise ValueError(f"TraceNVFP4Quantizer quantizes weights or inputs, not {what}")
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.what = what

    def copy(self) -> TraceNVFP4Quantizer:
        q = TraceNVFP4Quantizer(self.what, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        q.internal, q.optimize_for_gemm = self.internal, self.optimize_for_gemm
        return q

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (bf16/fp16/fp32) on the FP4 grid, same shape and dtype, no autograd edge."""
        site = active_site.get()
        with torch.no_grad():
            x = x.detach()
            if self.what is Treatment.FP4_WEIGHT:
                amax = None if site is None else site.weight_amax(x)
                return fake_quantize(x, "nvfp4", scale="tensor", global_amax=amax, check_finite=False)
            x_RK = x.reshape(-1, x.shape[-1])
            if site is None:
                return fake_quant_rows(x_RK).reshape(x.shape)
            guidance = site.guidance_rows(x_RK) if site.precision is TrainerPrecision.FP4_GUIDED else None
            return fake_quant_rows(x_RK, guidance, site.row_group).reshape(x.shape)

    def quantize_impl(self, tensor: torch.Tensor):
        return super().quantize_impl(self.fake_quantize(tensor))

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: torch.Tensor | None = None):
        return super().update_quantized(self.fake_quantize(src), dst, noop_flag=noop_flag)

    def is_requantization_safe(self) -> bool:
        return False  # requantizing FP4 grid values with another scale moves them


def trace_fp4_quantizer_factory(role) -> IdentityQuantizer:
    """The `CustomRecipe` factory: a quantizer per TE slot (`role`: a TE 2.9-2.15 string, a 2.16+
    `QuantizerRole`, or None). Weights and GEMM inputs get TRACE's NVFP4, every other slot
    TE's high-precision `IdentityQuantizer`."""
    what = treatment(parse_role(role))
    if what is Treatment.HIGH_PRECISION:
        return IdentityQuantizer()
    return TraceNVFP4Quantizer(what)
