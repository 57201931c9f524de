"""HostCopy: a GPU tensor's values on the host behind an event, read without draining the queue."""

from __future__ import annotations

import pytest
import torch

from tests.support.fp4 import EVENT_PATH_DEVICES as DEVICES
from tests.support.fp4 import HAS_CUDA
from trace_kernels.host_copy import HostCopy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_the_host_gets_the_values_as_they_were_when_copied(device, dtype):
    values = (torch.arange(-3, 9, device=device) % 3).to(dtype).reshape(3, 4)
    copy = HostCopy(values)
    want = values.cpu().clone()
    values.fill_(7)  # later work on the stream does not reach the copy
    got = copy.get()
    assert got.device.type == "cpu" and got.dtype == dtype and got.shape == (3, 4)
    assert torch.equal(got, want) and copy.ready()


@pytest.mark.skipif(not HAS_CUDA, reason="the event path needs a GPU")
def test_reading_waits_for_the_copy_not_for_work_queued_after_it():
    a = torch.randn(4096, 4096, device="cuda")
    flag = torch.tensor(True, device="cuda")
    torch.cuda.synchronize()
    copy = HostCopy(flag)
    for _ in range(20):  # ~tens of ms queued behind the copy
        a = a @ a / 64
    assert bool(copy.get())
    assert not torch.cuda.current_stream().query(), "the matmuls queued after the copy had already finished"
