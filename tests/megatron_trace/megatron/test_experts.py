"""The experts' gate scaling: one pass each way, the bits of torch's mixed-dtype expression."""

import torch

from megatron_trace.megatron.experts import scale_rows, swiglu


def test_scale_rows_gives_the_bits_and_gradients_of_the_float32_product_rounded_once():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 64, generator=g) * 3).bfloat16().requires_grad_()
    p = torch.rand(300, generator=g).requires_grad_()
    up = torch.randn(300, 64, generator=g).bfloat16()
    got = scale_rows(x, p)
    got.backward(up)
    x2, p2 = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    want = (x2 * p2.unsqueeze(-1)).to(torch.bfloat16)
    want.backward(up)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(x.grad, x2.grad) and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(p.grad, p2.grad, rtol=0, atol=0)
    # and against float64: the exact product (8 x 24 significand bits fit in 53) rounded to float32, then BF16
    exact = x.detach().double() * p.detach().double().unsqueeze(-1)
    assert torch.equal(got, exact.float().bfloat16())


def test_swiglu_is_torchs_silu_times_up_with_its_gradient():
    """On the CPU the torch composition itself; on a GPU (BF16) the fused kernels: forward bit for
    bit, gradient within one BF16 ulp of autograd's (trace_kernels' tests check the kernels)."""
    g = torch.Generator().manual_seed(1)
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        gate_up = (torch.randn(200, 96, generator=g) * 2).bfloat16().to(device)
        up_grad = torch.randn(200, 48, generator=g).bfloat16().to(device)
        a = gate_up.clone().requires_grad_()
        got = swiglu(a)
        got.backward(up_grad)
        b = gate_up.clone().requires_grad_()
        gate, up = b.chunk(2, -1)
        want = torch.nn.functional.silu(gate) * up
        want.backward(up_grad)
        assert torch.equal(got, want), device
        ulp = b.grad.float().abs() * 2**-7 + 2**-126
        assert ((a.grad.float() - b.grad.float()).abs() <= ulp).all(), device


def test_expert_offsets_are_the_running_sums_and_a_host_count_needs_no_host_synchronisation():
    """`expert_offsets` against numpy's cumsum, from host and device counts; on a GPU, host counts
    (as Megatron's dispatcher hands them over, pinned or not) go over without a stream sync."""
    import numpy as np
    import pytest

    from megatron_trace.megatron.experts import expert_offsets

    counts = torch.tensor([3, 0, 7, 1, 0, 12])
    want = np.cumsum(counts.numpy()).astype(np.int32)
    got = expert_offsets(counts, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()
    if not torch.cuda.is_available():
        return
    for host in (counts, counts.pin_memory()):
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = expert_offsets(host, torch.device("cuda"))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert got.is_cuda and got.cpu().tolist() == want.tolist()
    with pytest.raises(RuntimeError):  # the check itself: a pageable copy is a sync
        torch.cuda.set_sync_debug_mode("error")
        try:
            counts.to("cuda")
        finally:
            torch.cuda.set_sync_debug_mode(0)
