"""Whether a multi-process test fits this machine.

On the CPU every rank is a gloo process and any layout runs. Where CUDA is present each rank
takes a GPU of its own (megatron_trace.megatron.spawn), so a layout of more ranks than GPUs
cannot start there: such a test is skipped, naming what it needs (issue 29's multi-GPU runs
take it on a machine that has them).
"""

from __future__ import annotations

import pytest
import torch

from megatron_trace.megatron.spawn import world_size


def skip_unless_gpus_for(layout: dict, what: str = "this layout") -> None:
    """pytest.skip when CUDA is present with fewer GPUs than the Megatron `layout` (tp, pp, dp) has ranks."""
    need = world_size(layout)
    if torch.cuda.is_available() and need > torch.cuda.device_count():
        pytest.skip(f"{what} needs {need} GPUs, this machine has {torch.cuda.device_count()}")
