"""The straight-through mask of a fake quantization, and when the host learns it is all true.

`fake_quantize`'s backward passes the gradient where an element was not clipped. With the data's
own scales an element clips only in a block whose scale is an E4M3 subnormal (block max under
about 2^-6 / 448 of the amax), or under a scale given from outside. So the mask is almost always
all true, and multiplying the gradient by it is a pass over both for nothing.
Asking the GPU whether it is all true costs a host synchronisation, which drains the GPU's queue.
`ClipMask` asks without draining it: the answer (from the one-pass kernel's per-program flags, or
a reduction over the mask) is copied to pinned memory behind a CUDA event. The backward waits for
that event: the quantize it follows was queued long before, so the GPU keeps the work queued after
it, and the gradient is spared a pass in the common all-true case. A mask that was never written
(cached weights: `remake`) is computed only where the answer is no.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..host_copy import HostCopy


class ClipMask:
    """A bool mask (True where the gradient passes) whose all-true answer arrives later.

    Args:
        inside: bool, any shape, on any device (on the CPU the answer is known at once); None where
            the mask was not written (then `all_inside` and `remake` are needed).
        hold: keep the mask here (`get`), dropped once known all true. Without it only the answer
            is kept (`known_all_true`): autograd functions save the mask for backward themselves,
            so that saved-tensor hooks (offloading, checkpointing) see it.
        all_inside: 0-d bool, the answer where it is already computed (by the quantize kernel);
            else `inside.all()`.
        remake: () -> the mask, for a mask not written: called once, by `get`, if the answer is no.
    """

    def __init__(self, inside: torch.Tensor | None, hold: bool = True, all_inside: torch.Tensor | None = None,
                 remake: Callable[[], torch.Tensor] | None = None):
        if inside is None and (all_inside is None or remake is None):
            raise ValueError("ClipMask: a mask not written needs its answer (all_inside) and remake")
        self._mask: torch.Tensor | None = inside if hold else None
        self._remake = remake if inside is None else None
        self._answer = HostCopy(inside.all() if all_inside is None else all_inside)
        self._known: bool | None = None

    def settle(self, wait: bool = False) -> bool:
        """Reads the answer if it has arrived (with `wait`, waits for it); True once read. A held
        mask is dropped once known to be all true."""
        if self._known is None:
            if not (wait or self._answer.ready()):
                return False
            self._known = bool(self._answer.get())
            if self._known:
                self._mask = self._remake = None
        return True

    def known_all_true(self, wait: bool = False) -> bool:
        """Whether the mask is known to be all true (False also while the answer has not arrived)."""
        return self.settle(wait) and self._known

    def get(self, wait: bool = False) -> torch.Tensor | None:
        """The mask to multiply the gradient by, or None where it is known to be all true. A mask
        not written has nothing to apply before the answer: it waits for it."""
        self.settle(wait or self._remake is not None)
        if self._remake is not None and self._known is False:
            self._mask, self._remake = self._remake(), None
        return self._mask

    def part(self, i: int) -> ClipMaskPart:
        """Slice i along dim 0: one weight's mask, of weights quantized stacked."""
        return ClipMaskPart(self, i)


class ClipMaskPart:
    """Slice i (dim 0) of a held `ClipMask`."""

    def __init__(self, whole: ClipMask, i: int):
        self.whole, self.i = whole, i

    def get(self, wait: bool = False) -> torch.Tensor | None:
        mask = self.whole.get(wait)
        return None if mask is None else mask[self.i]
