"""Megatron's tensor-parallel linears with FP4 fake quantization of input and weight.

Both hook `_forward_impl`, the point where Megatron has the local input (before the
sequence-parallel all-gather of a column-parallel input, so FP4 rows are gathered) and the
weight shard, so every parallel mode and the gradient plumbing stay Megatron's own. A module
quantizes only once `attach_sites` has given it an `FP4Site`; until then it is a plain linear.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from .qat import SiteHolder


class _FP4LinearMixin(SiteHolder):

    def _forward_impl(self, input, weight, *args, **kwargs):
        site = self.fp4_site
        if site is not None and site.active:
            input, weight = site.quantize_input(input), site.quantize_weight(weight)
        return super()._forward_impl(input, weight, *args, **kwargs)


class FP4ColumnParallelLinear(_FP4LinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear (QKV projection, expert fc1) with FP4 input rows and weight."""


class FP4RowParallelLinear(_FP4LinearMixin, RowParallelLinear):
    """RowParallelLinear (attention output projection, expert fc2); its input rows are split
    over the tensor-parallel ranks by columns, so row global scales are all-reduced."""
