"""Routed experts: one after another, or as grouped GEMMs over all local experts.

Both keep Megatron's SequentialMLP parameters (`local_experts.{i}.linear_fc1/fc2`), so state
dicts, distributed checkpoints and weight loading are the same for either. Both apply the gate
weight to each expert's output: Megatron scales the fc1 activation before fc2, SGLang's and
vLLM's fused MoE kernels scale the fc2 output, and with per-row FP4 scales the two give
different fc2 inputs, so the trainer follows the engines (the fc2 site quantizes
act(gate) * up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from trace_kernels import moe_routing
from trace_kernels.fused_inputs import silu_mul, silu_mul_backward

from .qat import FP4Site


class _ScaleRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        ctx.save_for_backward(x, p)
        return moe_routing.scale_rows(x, p)

    @staticmethod
    def backward(ctx, grad):
        x, p = ctx.saved_tensors
        dx, dp = moe_routing.scale_rows_backward(grad.contiguous(), x, p)
        return (dx if ctx.needs_input_grad[0] else None), (dp if ctx.needs_input_grad[1] else None)


def scale_rows(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Expert outputs x [R, H] times their gate weights p float32 [R], computed in float32 and
    rounded to x's dtype once: [R, H] in x's dtype. BF16 rows go through
    `trace_kernels.moe_routing.scale_rows` (one kernel each way on a GPU; the plain expression
    writes, then reads, float32 [R, H] temporaries: 1 GB a layer at Qwen3-30B-A3B's 16384 tokens
    x 8 experts); other dtypes through torch."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and p.dtype == torch.float32:
        return _ScaleRows.apply(x, p)
    return (x * p.unsqueeze(-1)).to(x.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return silu_mul(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return silu_mul_backward(grad.contiguous(), gate_up)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of gate_up [R, 2F] (gate, then up): [R, F], the values torch computes. On
    a GPU in BF16 one kernel each way (`trace_kernels.fused_inputs`; torch: two forward on strided
    halves, five and a concatenation backward), and only gate_up saved for the backward."""
    if gate_up.is_cuda and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
        return _SwiGLU.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The grouped GEMMs' `offs`: where each local expert's rows end, int32 [E] on `device`, from
    rows per expert (integer [E], on the host as Megatron's dispatcher hands them over, or on the
    device). A host tensor goes over from pinned memory, so the copy does not wait for the GPU's
    queue (from pageable memory it would: a host synchronisation a layer)."""
    counts = tokens_per_expert
    if torch.device(device).type == "cuda" and not counts.is_cuda:
        counts = counts.pin_memory().to(device, non_blocking=True)
    return torch.cumsum(counts.to(device), 0).to(torch.int32)


class TraceSequentialMLP(SequentialMLP):
    """Each local expert's MLP (FP4 linears) on its tokens, in turn."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        chunks = torch.split(permuted_local_hidden_states, tokens_per_expert.tolist())
        out = torch.cat([expert(chunk)[0] for expert, chunk in zip(self.local_experts, chunks, strict=True)])
        return scale_rows(out, permuted_probs), None


class GroupedExpertSites:
    """Routed experts run as grouped GEMMs whose two FP4 sites, `fc1_site` and `fc2_site`, see
    every local expert at once (`all_experts=True`; set by `model.attach_sites`)."""

    fc1_site: FP4Site | None = None
    fc2_site: FP4Site | None = None


class TraceGroupedMLP(GroupedExpertSites, TraceSequentialMLP):
    """All local experts as two grouped GEMMs (`torch._grouped_mm`, on the GPU and the CPU).

    Its FP4 sites see every local expert at once (`all_experts=True`): fc2 rows are per-row
    scaled, so quantizing them together is the same as per expert; weights are quantized per
    expert with each expert's own global scale. (fc1 inputs arrive quantized, per token.)
    """

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        offs = expert_offsets(tokens_per_expert, x.device)
        # [E, 2F, H] and [E, H, F]; the fc1 input arrived quantized, per token
        w1 = self.fc1_site.quantize_expert_weights([e.linear_fc1.weight for e in self.local_experts])
        w2 = self.fc2_site.quantize_expert_weights([e.linear_fc2.weight for e in self.local_experts])
        act = self.fc2_site.quantize_input(swiglu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)))
        out = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        return scale_rows(out, permuted_probs), None
