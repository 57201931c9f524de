"""An FP4 site's input computed and fake-quantized in one kernel.

Two FP4 sites take rows that a small elementwise step has just made: qkv and fc1 take the
RMSNorm of the residual stream, fc2 takes SwiGLU's silu(gate) * up; fc1's residual stream is
itself fresh, the attention block's output (proj's product, K split) added to it
(`add_rms_norm_fake_quantize_rows`). At decode sizes each of those steps costs a launch, not
bytes, so on the GPU the quantize kernel computes them itself (`triton_fp4._quantize_kernel`,
PRE_*) and also writes the rows it made (the router, guidance capture and the residual stream
need them).

The results are the torch composition's: the norm as `norm_rope.rms_norm` computes it (torch's
composite, the sum of squares in another order), silu(gate) * up with torch's own rounding, then
`fake_quantize_rows` of those rows. The torch path (CPU, or backend="torch") is that composition.

Shapes: x bf16 [R, K], weight float32 [K]; gate_up bf16 [R, 2I] (gate, then up); K and I
multiples of 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp4.api import _use_triton, fake_quantize_rows
from .fp4.linear import sum_parts

try:
    import triton
    import triton.language as tl

    from .fp4 import triton_fp4
    from .fp4.triton_fp4 import _bf16, _exp, _interpreting, _silu_mul
except ImportError:  # pragma: no cover - triton is optional on the CPU
    triton = None


def _check_rows(x: torch.Tensor, what: str, width: int) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] % width:
        raise ValueError(f"{what}: rows must be bfloat16 [R, a multiple of {width}], got {x.dtype} {tuple(x.shape)}")


def rms_norm_fake_quantize_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, *, capture: bool = False,
                                backend: str = "auto"):
    """Row-scaled NVFP4 fake quantization of F.rms_norm(x, weight): x bf16 [R, K], weight
    float32 [K].

    Returns:
        (fake-quantized rows bf16 [R, K], the norm's rows bf16 [R, K], None or, with `capture`,
         (mantissa bits uint8 [R, K/8], block scale bytes uint8 [R, K/16], g float32 [R]))."""
    _check_rows(x, "rms_norm_fake_quantize_rows", 16)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm_fake_quantize_rows: weight {tuple(weight.shape)} does not fit rows of {x.shape[1]}")
    if not _use_triton(x, backend):
        h = F.rms_norm(x, (x.shape[1],), weight, eps)
        xq, kept = fake_quantize_rows(h, capture=capture, backend="torch")
        return xq, h, kept
    xq, bits, scales, g, _, h = triton_fp4.fake_quantize_rows_triton(
        x.contiguous(), capture, triton_fp4.PRE_RMS_NORM, weight.float().contiguous(), eps)
    return xq, h, (bits, scales, g) if capture else None


def add_rms_norm_fake_quantize_rows(product: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                    *, capture: bool = False, backend: str = "auto"):
    """`rms_norm_fake_quantize_rows` of x = residual + product, in the same one kernel on the GPU:
    product as `linear.fp4_linear_parts` leaves it (bf16 [R, K], or a split-K GEMM's FP32 partial
    products [S, R, K], added as `sum_parts` adds them), residual bf16 [R, K]. The sum is the
    block's output, the residual stream after it.

    Returns:
        (fake-quantized rows bf16 [R, K], the norm's rows bf16 [R, K], None or the capture as
         `rms_norm_fake_quantize_rows`'s, x bf16 [R, K])."""
    _check_rows(residual, "add_rms_norm_fake_quantize_rows", 16)
    if product.shape[-2:] != residual.shape or product.dim() not in (2, 3) or \
            product.dtype != (torch.float32 if product.dim() == 3 else torch.bfloat16):
        raise ValueError(f"add_rms_norm_fake_quantize_rows: product must be bfloat16 {list(residual.shape)} or float32 "
                         f"[S, {residual.shape[0]}, {residual.shape[1]}], got {product.dtype} {tuple(product.shape)}")
    if not _use_triton(residual, backend):
        x = sum_parts(product, residual)
        return *rms_norm_fake_quantize_rows(x, weight, eps, capture=capture, backend="torch"), x
    if weight.shape != (residual.shape[1],):
        raise ValueError(f"add_rms_norm_fake_quantize_rows: weight {tuple(weight.shape)} does not fit rows of "
                         f"{residual.shape[1]}")
    x = torch.empty_like(residual)
    xq, bits, scales, g, _, h = triton_fp4.fake_quantize_rows_triton(
        product.contiguous(), capture, triton_fp4.PRE_RMS_NORM, weight.float().contiguous(), eps,
        residual=residual.contiguous(), sum_out=x)
    return xq, h, (bits, scales, g) if capture else None, x


def silu_mul_fake_quantize_rows(gate_up: torch.Tensor, *, capture: bool = False, backend: str = "auto"):
    """Row-scaled NVFP4 fake quantization of silu(gate) * up, gate_up bf16 [R, 2I].

    Returns:
        (fake-quantized rows bf16 [R, I], silu(gate) * up bf16 [R, I], None or, with `capture`,
         (mantissa bits uint8 [R, I/8], block scale bytes uint8 [R, I/16], g float32 [R]))."""
    _check_rows(gate_up, "silu_mul_fake_quantize_rows", 32)
    if not _use_triton(gate_up, backend):
        act = silu_mul(gate_up, backend="torch")
        xq, kept = fake_quantize_rows(act, capture=capture, backend="torch")
        return xq, act, kept
    xq, bits, scales, g, _, act = triton_fp4.fake_quantize_rows_triton(
        gate_up.contiguous(), capture, triton_fp4.PRE_SILU_MUL)
    return xq, act, (bits, scales, g) if capture else None


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """F.silu(gate) * up of gate_up bf16 [R, 2I] (gate, then up): bf16 [R, I], one kernel on the GPU."""
    _check_rows(gate_up, "silu_mul", 2)
    if not _use_triton(gate_up, backend):
        g, u = gate_up.chunk(2, -1)
        return F.silu(g) * u
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up.contiguous(), out, width, BLOCK=block,
                                                            INTERPRET=_interpreting(), enable_fp_fusion=False)
    return out


def silu_mul_backward(grad: torch.Tensor, gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The gradient of `silu_mul` as torch's autograd computes it for F.silu(gate) * up: grad bf16
    [R, I], gate_up bf16 [R, 2I] -> d(gate_up) bf16 [R, 2I]: d_up = grad * silu(gate) (silu
    rounded to BF16 first, as the forward had it), d_gate = silu_backward(grad * up, gate), each
    product rounded to BF16 as there. One kernel on the GPU (torch: five, and a concatenation)."""
    _check_rows(gate_up, "silu_mul_backward", 2)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if grad.shape != (rows, width) or grad.dtype != gate_up.dtype:
        raise ValueError(f"silu_mul_backward: grad must be bfloat16 {(rows, width)}, got {grad.dtype} "
                         f"{tuple(grad.shape)}")
    if not _use_triton(gate_up, backend):
        g, u = gate_up.chunk(2, -1)
        return torch.cat([torch.ops.aten.silu_backward(grad * u, g), grad * F.silu(g)], -1)
    out = torch.empty_like(gate_up)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_mul_backward_kernel[(rows, triton.cdiv(width, block))](
            grad.contiguous(), gate_up.contiguous(), out, width, BLOCK=block, INTERPRET=_interpreting(),
            enable_fp_fusion=False)
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_backward_kernel(grad_ptr, x_ptr, out_ptr, I, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        dy = tl.load(grad_ptr + row * I + cols, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(x_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
        sig = tl.div_rn(1.0, 1.0 + _exp(-gate, INTERPRET))
        silu = _bf16(tl.div_rn(gate, 1.0 + _exp(-gate, INTERPRET)), INTERPRET).to(tl.float32)
        d_silu = _bf16(dy * up, INTERPRET).to(tl.float32)
        # torch's silu_backward: dy * s * (1 + x * (1 - s)) in float32
        d_gate = d_silu * sig * (1.0 + gate * (1.0 - sig))
        tl.store(out_ptr + row * 2 * I + cols, _bf16(d_gate, INTERPRET), mask=ok)
        tl.store(out_ptr + row * 2 * I + I + cols, _bf16(dy * silu, INTERPRET), mask=ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(x_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * I + cols, _silu_mul(gate, up, INTERPRET), mask=ok)
