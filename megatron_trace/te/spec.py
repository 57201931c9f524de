"""TRACE's Megatron layer spec on Transformer Engine's linears (`trainer.transformer_impl=transformer_engine`).

The spec is the local one (megatron/spec.py: TRACE's RMSNorms, the core attention with the K/V
sites, the MoE layer with routing replay and guidance dispatch) with Megatron's TE wrappers for
the linears: `TEColumnParallelLinear` (QKV, fc1 of dense and shared experts),
`TERowParallelLinear` (output projection, fc2) and TE's grouped linears for the routed experts
(`TraceTEGroupedMLP`). `te_linears().config` is Megatron's own selection: `transformer_impl=
"transformer_engine"`, and TE's autocast with TRACE's recipe (`fp4="e2m1"`, `fp4_recipe="custom"`,
`fp4_quantizer_factory` = `recipe.trace_fp4_quantizer_factory`).

- QKV reads TRACE's RMSNorm output (TEColumnParallelLinear, not TE's fused
  TELayerNormColumnParallelLinear): the FP4 codes are decided on the norm's BF16 output, which
  TRACE's norm gives as the engine's does; another norm kernel would move codes at rounding points.
- Each TE linear sets `recipe.active_site` to its FP4 site around its forward, so the recipe's
  quantizers use the site's precision, weight amax group and guidance rows; a grouped linear
  also tells each input quantizer which expert (GEMM) it serves.
- On Hopper (the emulated path) TRACE quantizes GEMM inputs before TE sees them, with the local
  spec's straight-through backward: the plain linears their own rows (`_InputQuantizedFirst`),
  the grouped experts all experts' fc2 rows at once, and in the trainer's cache scope the expert
  weights at once (`TraceTEGroupedMLP`); TE's slots then pass them through. On the native path
  TE's slots quantize (they must build the FP4 storage), and under sequence parallelism TE
  all-gathers a column-parallel input in high precision before a custom recipe's quantizer
  sees it (`distributed.gather_along_first_dim`), so those slots take the whole micro-batch's
  rows (per-row scales: the same values as quantizing each shard).
- Multi-head latent attention stays on the local spec.

Written against TE 2.20.2 and megatron-core 0.19. TE's modules need CUDA: on the CPU the spec's
structure is tested (tests/support/te_cpu.py imports TE's Python), on a GPU with TE built
tests/megatron_trace/te/test_te_gpu.py runs it against the local spec.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial

import torch
from megatron.core.extensions.transformer_engine import (
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

from ..megatron.experts import GroupedExpertSites, TraceSequentialMLP, scale_rows, swiglu
from ..megatron.qat import FP4Site, SiteHolder, caching_weights
from ..megatron.spec import Linears
from .recipe import TraceNVFP4Quantizer, active_site, input_prequantized, native_nvfp4_default

FACTORY = "megatron_trace.te.recipe.trace_fp4_quantizer_factory"


class _SiteScoped(SiteHolder):
    """A TE linear whose forward runs with its FP4 site active (`recipe.active_site`)."""

    gathers_input = False  # column-parallel: TE all-gathers a sequence-parallel input first

    @property
    def fp4_site(self) -> FP4Site | None:
        """The site TE's quantizer slots see (of the gathered rows where TE gathers the input)."""
        return self.__dict__.get("_fp4_site")

    @fp4_site.setter
    def fp4_site(self, site: FP4Site | None) -> None:
        self.__dict__["_own_site"] = site  # the site of this rank's own input rows
        if site is not None and self.gathers_input and site.tokens is not None:
            site = replace(site, tokens=None)
        self.__dict__["_fp4_site"] = site

    def forward(self, *args, **kwargs):
        token = active_site.set(self.fp4_site)
        try:
            return super().forward(*args, **kwargs)
        finally:
            active_site.reset(token)

    def get_extra_state(self) -> torch.Tensor:
        """TE's "no quantization state" marker, an empty uint8 tensor: TRACE's recipe keeps no
        state between steps (scales come from the tensor at hand; the factory is named in the
        config). TE 2.20 would pickle the CustomRecipe, factory callable and all, which Megatron's
        checkpoint code refuses to unpickle (`safe_globals.SafeUnpickler` admits TE's built-in
        recipes only) and which would tie a checkpoint to a Python path."""
        return torch.empty(0, dtype=torch.uint8)


class _InputQuantizedFirst(_SiteScoped):
    """A plain TE linear (one GEMM) whose input rows TRACE fake-quantizes before TE sees them, on
    the emulated path: the local spec's `quantize_input` of this rank's rows (before TE's
    sequence-parallel gather; per-row scales give the same values as after it), with its
    straight-through backward, which zeroes the gradient of elements a guided scale clipped (TE's
    quantizer slot would pass every gradient). TE's input slot then passes the rows through
    (`recipe.input_prequantized`). The native path leaves the input to TE's slot, which must
    produce the FP4 storage itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.emulated = not native_nvfp4_default()

    def forward(self, x, *args, **kwargs):
        site = self.__dict__.get("_own_site")
        if not (self.emulated and site is not None and site.active and site.quantizes_input):
            return super().forward(x, *args, **kwargs)
        x = site.quantize_input(x)
        token = input_prequantized.set(True)
        try:
            return super().forward(x, *args, **kwargs)
        finally:
            input_prequantized.reset(token)


class _GroupedSiteScoped(_SiteScoped):
    def _get_quantizers(self):
        # TE's GroupedLinear quantizes expert i's rows with input quantizer i (after building them)
        quantizers = super()._get_quantizers()
        for i, q in enumerate(quantizers[0]):
            if isinstance(q, TraceNVFP4Quantizer):
                q.gemm = i
        return quantizers


class TraceTEColumnParallelLinear(_InputQuantizedFirst, TEColumnParallelLinear):
    """Megatron's TEColumnParallelLinear at an FP4 site (QKV; fc1 of dense and shared experts)."""

    gathers_input = True


class TraceTERowParallelLinear(_InputQuantizedFirst, TERowParallelLinear):
    """Megatron's TERowParallelLinear at an FP4 site (output projection; fc2)."""


class TraceTEColumnParallelGroupedLinear(_GroupedSiteScoped, TEColumnParallelGroupedLinear):
    """The routed experts' fc1 as one TE grouped linear (its input arrives quantized per token)."""


class TraceTERowParallelGroupedLinear(_GroupedSiteScoped, TERowParallelGroupedLinear):
    """The routed experts' fc2 as one TE grouped linear."""


def _held_by(linear: str) -> property:
    """The FP4 site of the submodule `linear` (read and set through it)."""
    return property(lambda self: getattr(self, linear).fp4_site,
                    lambda self, site: setattr(getattr(self, linear), "fp4_site", site))


class TraceTEGroupedMLP(GroupedExpertSites, TEGroupedMLP):
    """Megatron's TEGroupedMLP with TRACE's expert sites and the engines' gate placement: the
    router's weight scales the fc2 output (as TraceGroupedMLP does, experts.py says why), not
    the fc1 activation. Each expert's rows are padded as TEGroupedMLP pads them under an FP4
    recipe; the recipe's quantizers leave the padding out of the guidance rows."""

    fc1_site = _held_by("linear_fc1")
    fc2_site = _held_by("linear_fc2")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # On the emulated path the fc2 input (and, in the trainer, the expert weights) is quantized
        # here in one pass over all experts (per-row or per-expert scales: the same values as per
        # expert), not by TE's one quantizer call per expert. The native path leaves it to TE's
        # quantizers, which must produce the FP4 storage themselves.
        self.emulated = not native_nvfp4_default()

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """x [rows, H] (rows grouped by local expert, `tokens_per_expert` int [E] of them), the
        router's weights [rows] -> ([rows, H] in x's dtype, None)."""
        self._quantize_expert_weights_at_once()
        x, counts = permuted_local_hidden_states, tokens_per_expert.tolist()
        padding = getattr(self, "quantization_padding", None)  # set by TEGroupedMLP under an FP4 recipe
        splits = counts
        if padding is not None:
            x, splits = padding(x, counts)
        h, _ = self.linear_fc1(x, splits)
        act = swiglu(h)
        site = self.fc2_site
        if not (self.emulated and site is not None and site.active):
            out, _ = self.linear_fc2(act, splits)
        else:
            token = input_prequantized.set(True)
            try:
                out, _ = self.linear_fc2(_quantize_real_rows(site, act, counts, splits), splits)
            finally:
                input_prequantized.reset(token)
        if padding is not None:
            out = self.quantization_unpadding(out, counts)
        return scale_rows(out, permuted_probs), None

    def _quantize_expert_weights_at_once(self) -> None:
        """In the trainer (a `qat.cached_weights` scope), fake-quantize each grouped linear's expert
        weights in one pass: TE's weight slots, called expert by expert, then find their weight in
        the cache instead of quantizing it alone (a few kernels per expert). The emulated path only."""
        if not (self.emulated and caching_weights()):
            return
        with torch.no_grad():
            for linear, site in ((self.linear_fc1, self.fc1_site), (self.linear_fc2, self.fc2_site)):
                if site is not None and site.active:
                    site.quantize_expert_weights([getattr(linear, f"weight{i}") for i in range(linear.num_gemms)])


def _quantize_real_rows(site: FP4Site, act: torch.Tensor, counts: list[int], splits: list[int]) -> torch.Tensor:
    """`site.quantize_input` of the dispatched rows (counts[i] of expert i) inside act [sum(splits), F],
    where TE's padding put splits[i] >= counts[i] rows per expert; padding rows (zeros) stay as they are."""
    if list(splits) == list(counts):
        return site.quantize_input(act)
    starts = [0, *itertools.accumulate(splits)][:-1]
    idx = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts, strict=True)]).to(act.device)
    return act.index_put((idx,), site.quantize_input(act[idx]))


def _te_experts(grouped_gemm: bool):
    if grouped_gemm:
        return partial(TraceTEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=TraceTEColumnParallelGroupedLinear, linear_fc2=TraceTERowParallelGroupedLinear))
    return partial(TraceSequentialMLP, submodules=MLPSubmodules(
        linear_fc1=TraceTEColumnParallelLinear, linear_fc2=TraceTERowParallelLinear, activation_func=None))


def te_linears() -> Linears:
    """TE's linears for `model.build_model(linears=...)`, with the TransformerConfig settings that
    put TRACE's recipe on them. Always on: a site in BF16 precision passes values through.

    TE's own weight cache is off (`disable_parameter_transpose_cache`): it holds a weight quantized
    at the first micro-batch until Megatron's schedule says a new step began, so a forward outside
    the schedule, or after a precision switch, would compute with a stale weight. TRACE's weight
    cache (`qat.cached_weights`, keyed on the parameter's version) does that job for both specs.

    TE's quantized execution asserts that a GEMM input's leading dimensions multiply to a multiple
    of 8 (`assert_dim_for_fp8_exec`, custom recipes included), and NVFP4's 1x16 tiles along the
    tokens want 16 for the transposed operand: micro-batches are padded to 16 tokens, as Megatron
    pads sequences under FP8/FP4."""
    return Linears("transformer_engine", TraceTEColumnParallelLinear, TraceTERowParallelLinear, _te_experts,
                   mla=False, config={"transformer_impl": "transformer_engine", "fp4": "e2m1", "fp4_recipe": "custom",
                                      "fp4_quantizer_factory": FACTORY, "disable_parameter_transpose_cache": True},
                   token_multiple=16)

