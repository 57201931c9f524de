"""TRACE's TE recipe inside TE's own modules, on a GPU with TE built (bench/gpu_te.sh): te.Linear and
te.GroupedLinear under `autocast(recipe=CustomRecipe(trace_fp4_quantizer_factory))` against the
local spec's FP4 math (inputs per row, weights per tensor, BF16 GEMMs on the FP4 grid values),
forward and gradients. TE's extension needs CUDA: on a CPU machine this module is skipped, and
tests/megatron_trace/te/test_te_cpu.py covers the recipe against TE's Python classes there."""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch", reason="TE with its extension: a GPU machine (bench/gpu_te.sh)")
if not torch.cuda.is_available():
    pytest.skip("TE's modules need CUDA", allow_module_level=True)

from transformer_engine.common.recipe import CustomRecipe  # noqa: E402

from megatron_trace.te.recipe import trace_fp4_quantizer_factory  # noqa: E402
from trace_kernels.fp4 import fake_quantize  # noqa: E402

RECIPE = CustomRecipe(qfactory=trace_fp4_quantizer_factory)


def fp4_rows(x):
    return fake_quantize(x, "nvfp4", scale="row", check_finite=False)


def fp4_tensor(w):
    return fake_quantize(w, "nvfp4", scale="tensor", check_finite=False)


def test_te_linear_runs_traces_fp4_math():
    torch.manual_seed(0)
    lin = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = (torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_()
    with te.autocast(enabled=True, recipe=RECIPE):
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = lin.weight.detach()
    xq, wq = fp4_rows(x.detach()), fp4_tensor(w)
    torch.testing.assert_close(y, xq @ wq.t(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, dy @ wq, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(lin.weight.grad, dy.t() @ xq, rtol=1.6e-2, atol=1e-2)
    assert not torch.allclose(y, x.detach() @ w.t(), rtol=1e-3, atol=1e-3)  # FP4 moved it


def test_te_grouped_linear_runs_traces_fp4_math():
    torch.manual_seed(1)
    splits = [48, 0, 80, 16]
    lin = te.GroupedLinear(len(splits), 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(sum(splits), 256, device="cuda", dtype=torch.bfloat16).requires_grad_()
    m_splits = torch.tensor(splits, dtype=torch.int64, device="cuda")
    with te.autocast(enabled=True, recipe=RECIPE):
        y = lin(x, m_splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    for i, (xi, dyi) in enumerate(zip(x.detach().split(splits), dy.split(splits), strict=True)):
        w = getattr(lin, f"weight{i}")
        wq = fp4_tensor(w.detach())
        lo = sum(splits[:i])
        torch.testing.assert_close(y[lo: lo + splits[i]], fp4_rows(xi) @ wq.t(), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(x.grad[lo: lo + splits[i]], dyi @ wq, rtol=1.6e-2, atol=1e-2)
        if splits[i]:
            torch.testing.assert_close(w.grad, dyi.t() @ fp4_rows(xi), rtol=1.6e-2, atol=1e-2)
