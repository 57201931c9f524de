"""Helpers shared by the FP4 kernel tests."""

import math

import numpy as np
import pytest
import torch

from trace_kernels.fp4 import E2M1_MAGNITUDES, dequantize, quantize

BACKENDS = ("torch", "triton")
HAS_CUDA = torch.cuda.is_available()
# the CPU, and the GPU where there is one: results read on the host behind a CUDA event
EVENT_PATH_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA,
                                                                           reason="the event path needs a GPU"))]


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


def paged_fp4_cache(lens, hkv, d, block_size, seed, garbage=False):
    """A paged NVFP4 K and V cache [slots, hkv, d] holding sequences of `lens` tokens in scattered
    blocks: (caches, block tables int32 [B, width], lengths int32 [B], per sequence its (K, V)
    rows dequantized to float64 [n, hkv, d]). Values are heavy-tailed across tokens. garbage:
    unused slots hold random codes and NaN scales and g (as a reused block might), which an
    attention kernel must keep out of its output; else zeros."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(math.ceil(n / block_size) for n in lens) + 3
    slots = nblocks * block_size
    fill = (0x7F, float("nan")) if garbage else (0, 1.0)
    codes = (lambda: torch.randint(0, 256, (slots, hkv, d // 2), dtype=torch.uint8, generator=g)) if garbage else (
        lambda: torch.zeros(slots, hkv, d // 2, dtype=torch.uint8))
    cache = [{"codes": codes(), "scales": torch.full((slots, hkv, d // 16), fill[0], dtype=torch.uint8),
              "g": torch.full((slots, hkv, 1), fill[1])} for _ in range(2)]
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = max(math.ceil(n / block_size) for n in lens)
    tables, rows = [], []
    for n in lens:
        blocks = [perm.pop() for _ in range(math.ceil(n / block_size))]
        pos = torch.arange(n)
        slot = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        kv = []
        for c in cache:
            t = quantize(torch.randn(n, hkv, d, generator=g) * torch.exp(torch.randn(n, hkv, 1, generator=g)),
                         scale="row")
            c["codes"][slot], c["scales"][slot], c["g"][slot] = (t.codes, t.block_scales.view(torch.uint8),
                                                                 t.global_scale)
            kv.append(dequantize(t, torch.bfloat16).double())
        rows.append(kv)
        tables.append(blocks + [0] * (width - len(blocks)))
    return cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), rows
