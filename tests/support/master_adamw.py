"""The optimizer TRACE used before Megatron's, kept as a reference for tests and benchmarks:
torch's AdamW on FP32 master copies of the BF16 parameters, which are set from them after each
step (16 B of state per parameter on every data-parallel replica; gradients in `.grad`)."""

from __future__ import annotations

import torch


class MasterAdamW:
    """zero_grad / scale_grads / step as `megatron_trace.megatron.optimizer.TrainerOptimizer`
    (its `ddp` is the model itself: gradients stay in the parameters' .grad)."""

    def __init__(self, model: torch.nn.Module, lr: float):
        self.ddp, self.params = model, [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def scale_grads(self, factor: float) -> None:
        for p in self.params:
            p.grad.mul_(factor)

    @torch.no_grad()
    def step(self) -> dict:
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = p.grad.float()
        norm = float(torch.linalg.vector_norm(torch.stack([m.grad.double().norm() for m in self.master])))
        self.opt.step()
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)
            m.grad = None
        return {"grad_norm": norm}

    def state_bytes(self) -> int:
        """FP32 masters and AdamW moments, from the live tensors."""
        moments = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values() if t.dim())
        return sum(m.numel() * 4 for m in self.master) + moments
