"""AdamW on FP32 master copies of BF16 parameters.

The trainer computes in BF16 like the engine (so only rounding separates the two paths), while
small updates accumulate in FP32 instead of vanishing under BF16's 8-bit mantissa.
"""

from __future__ import annotations

import torch


class MasterAdamW:
    """zero_grad / step like a torch optimizer over `params` (any dtype)."""

    def __init__(self, params, lr: float, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)
            m.grad = None  # the FP32 copies live only during the step

    def state_dict(self) -> dict:
        """FP32 master weights and AdamW state (what a resumed run needs beyond the BF16 weights)."""
        return {"master": [m.detach() for m in self.master], "adamw": self.opt.state_dict()}  # views: save, not keep

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s content; the BF16 parameters are set from the masters."""
        if [m.shape for m in state["master"]] != [m.shape for m in self.master]:
            raise ValueError("optimizer state does not fit these parameters (different model or layout)")
        for m, saved, p in zip(self.master, state["master"], self.params, strict=True):
            m.copy_(saved)
            p.copy_(m)
        self.opt.load_state_dict(state["adamw"])
