"""Helpers shared by the FP4 kernel tests."""

import numpy as np
import torch
from trace_kernels.fp4 import E2M1_MAGNITUDES, dequantize, quantize

BACKENDS = ("torch", "triton")
HAS_CUDA = torch.cuda.is_available()


def triton_device() -> str:
    """Where the Triton backend runs: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def quantize_on(backend, x, *args, **kwargs):
    """quantize() with the given backend, on that backend's device; the QTensor comes back on the CPU."""
    dev = triton_device() if backend == "triton" else "cpu"
    if isinstance(kwargs.get("global_amax"), torch.Tensor):
        kwargs["global_amax"] = kwargs["global_amax"].to(dev)
    return quantize(x.to(dev), *args, backend=backend, **kwargs).to("cpu")


def dequantize_on(backend, q, dtype=torch.float32):
    dev = triton_device() if backend == "triton" else "cpu"
    return dequantize(q.to(dev), dtype, backend=backend).cpu()


def heavy_tailed(m, k, seed=0, dtype=torch.float32):
    """Activations with per-channel outliers, like real LLM inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(0.8 * torch.randn(1, k, generator=g))
    return x.to(dtype)


def assert_same_qtensor(a, b):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
    if a.global_scale is None:
        assert b.global_scale is None
    else:
        assert torch.equal(a.global_scale.view(torch.int32), b.global_scale.view(torch.int32))


def assert_bitwise_equal(a, b):
    """Equal bits, so -0.0 and 0.0 differ (torch.equal would call them equal)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    assert torch.equal(a.view(ints), b.view(ints))


def e2m1_sweep():
    """Dense float32 values in [-6.5, 6.5]: a 2**-10 grid, every tie point and its neighbours."""
    grid = np.arange(-6.5, 6.5, 2.0**-10, dtype=np.float32)
    mags = np.array(E2M1_MAGNITUDES, dtype=np.float32)
    ties = ((mags[1:] + mags[:-1]) / 2).astype(np.float32)
    near = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 10)])
    return np.concatenate([grid, near, -near, [0.0, -0.0, 6.0, -6.0]]).astype(np.float32)
