"""A small GPU result for the host, later, without draining the GPU's queue.

Reading a GPU tensor (`.item()`, `.tolist()`, `bool()`) waits for every kernel queued so far, so
the GPU idles while the host queues what comes next. `HostCopy` copies the tensor to pinned
memory behind a CUDA event instead: reading waits only for the work queued before the copy,
which is usually done by the time the host, far ahead, asks.
"""

from __future__ import annotations

import torch


class HostCopy:
    """`values` (any shape and dtype, on any device) on its way to the host.

    The copy holds the values as they are when it is made, on any device: on the CPU a clone, at
    hand at once; on a GPU a copy to pinned memory on its device's current stream, an event
    recorded after it.
    """

    def __init__(self, values: torch.Tensor):
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(values.device))  # the stream the copy went on
        else:
            self._host, self._copied = values.clone(), None

    def ready(self) -> bool:
        """Whether the values have arrived (never waits)."""
        return self._copied is None or self._copied.query()

    def get(self) -> torch.Tensor:
        """The values on the CPU, waiting for their copy (and only for the work queued before it)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._host
