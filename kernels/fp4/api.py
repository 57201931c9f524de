"""Public FP4 entry points: quantize, dequantize, fake_quantize.

They validate input, pick the backend (Triton on CUDA, the torch reference elsewhere; the
two agree bit for bit) and assemble a `QTensor`.
"""

from __future__ import annotations

import os

import torch

from . import reference
from .clip_mask import ClipMask
from .formats import Format, MXScaleRule, e4m3_to_float, e8m0_to_float
from .packing import mantissa_bits, pack_codes, unpack_bits, unpack_codes
from .qtensor import QTensor
from .rng import seed_key

try:  # Triton is optional on the CPU; CUDA builds of torch bring it.
    from . import triton_fp4
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton_fp4 = None

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_MODES = ("tensor", "row")
ROUNDING_MODES = ("rne", "stochastic")
BACKENDS = ("auto", "torch", "triton")


def _parse_format(fmt: str | Format) -> Format:
    try:
        return Format(fmt)
    except ValueError:
        raise ValueError(f"unsupported FP4 format {fmt!r}; choose one of {[f.value for f in Format]}") from None


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "torch":
        return False
    if backend == "triton":
        if triton_fp4 is None:
            raise ValueError("backend='triton' requested but triton is not installed")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1")
        return True
    return triton_fp4 is not None and x.is_cuda


def _validate_input(x: torch.Tensor, fmt: Format) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype} for FP4 quantization; use one of {SUPPORTED_DTYPES}")
    bs = fmt.block_size
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % bs:
        raise ValueError(
            f"{fmt.value} needs a last dimension that is a positive multiple of its block size {bs}, "
            f"got shape {tuple(x.shape)} (no padding is done)"
        )


def _raise_nonfinite(where: str) -> None:
    raise ValueError(f"FP4 quantize input contains NaN or Inf ({where}); refusing to produce codes")


def _check_quantize_args(x, fmt, scale, rounding, seed, global_amax, check_finite):
    """`quantize`'s argument checks; returns (Format, row_scale, global_amax float32 on x's device
    or None)."""
    fmt = _parse_format(fmt)
    _validate_input(x, fmt)
    if fmt is Format.MXFP4 and scale is not None:
        raise ValueError(f"mxfp4 has no global scale, so scale must be None (got {scale!r})")
    scale = scale or "tensor"
    if scale not in SCALE_MODES:
        raise ValueError(f"unknown scale mode {scale!r}; choose one of {SCALE_MODES}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {ROUNDING_MODES}")
    if seed is not None and rounding != "stochastic":
        raise ValueError("seed is only used by rounding='stochastic'")
    row_scale = fmt is Format.NVFP4 and scale == "row"
    if global_amax is not None:
        if fmt is not Format.NVFP4:
            raise ValueError("global_amax applies only to nvfp4")
        want = tuple(x.shape[:-1]) + (1,) if row_scale else ()
        if tuple(global_amax.shape) != want:
            raise ValueError(f"global_amax must have shape {want} for scale={scale!r} and x of shape "
                             f"{tuple(x.shape)}, got {tuple(global_amax.shape)}")
        if check_finite and not bool((torch.isfinite(global_amax) & (global_amax >= 0)).all()):
            raise ValueError("global_amax must be a finite non-negative amax")
        # On x's device: a CPU 0-d divisor would be a CUDA scalar, divided by reciprocal.
        global_amax = global_amax.to(x.device, torch.float32)
    return fmt, row_scale, global_amax


def amax(t: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |t| (over `dim`, default all) as float32, in one read of t with no temporary the size of
    t (`t.abs().amax()` writes one); NaN where an element is NaN, as amax. What NVFP4's global
    scales are computed from."""
    return torch.linalg.vector_norm(t.detach(), float("inf"), dim=dim, keepdim=keepdim, dtype=torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: str | Format = "nvfp4",
    scale: str | None = None,
    rounding: str = "rne",
    seed: int | None = None,
    *,
    global_amax: torch.Tensor | None = None,
    mx_scale_rule: str | MXScaleRule = "floor",
    backend: str = "auto",
    check_finite: bool = True,
) -> QTensor:
    """Quantize `x` to FP4 along its last dimension (docs/design.md section 2).

    Args:
        x: float32/bfloat16/float16 [..., K], K a multiple of the block size (16 nvfp4,
            32 mxfp4), finite.
        fmt: "nvfp4" or "mxfp4".
        scale: NVFP4 global scale granularity: "tensor" (default; one g, a 0-d tensor) or
            "row" (one g per row, [..., 1]). Must be None for MXFP4, which has none.
        rounding: "rne" or "stochastic" (counter-based: same seed and input, same codes on
            any device). Block scales always round to nearest.
        seed: stochastic rounding seed; None draws one from torch's default generator.
        global_amax: NVFP4 only: the amax to derive g from instead of x's own, for example
            one all-reduced over tensor- and expert-parallel shards so that every shard
            quantizes with the g of the whole logical tensor (or row). A 0-d tensor with
            scale="tensor"; [..., 1] (one per row) with scale="row". Elements above it saturate.
        mx_scale_rule: MXFP4 block scale rule, "floor" (OCP) or "ceil" (never saturates).
        backend: "auto" (Triton on CUDA tensors, torch elsewhere), "torch" or "triton".
        check_finite: refuse NaN/Inf. On the GPU this costs one host synchronisation per
            call; hot loops that check their loss for NaN anyway may pass False, and then
            get unspecified (but never NaN) codes for non-finite input.

    Returns:
        QTensor with codes uint8 [..., K/2], block scales [..., K/bs], global scale.

    Raises:
        ValueError: unsupported dtype, format, scale, rounding or backend; a last dimension
            that is not a multiple of the block size; NaN or Inf in `x`.
    """
    fmt, row_scale, global_amax = _check_quantize_args(x, fmt, scale, rounding, seed, global_amax, check_finite)
    stochastic = rounding == "stochastic"
    if stochastic and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    key = seed_key(seed) if stochastic else 0
    mx_rule = MXScaleRule(mx_scale_rule)

    lead, k = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, k).contiguous()
    need_amax = fmt is Format.NVFP4 and not row_scale and global_amax is None

    if _use_triton(x, backend):
        if need_amax:
            global_amax = amax(x_MK)
        row_amax = global_amax.reshape(-1) if row_scale and global_amax is not None else None
        packed, scale_bytes, g, bad = triton_fp4.quantize_rows_triton(
            x_MK, fmt, row_scale, stochastic, key, None if row_scale else global_amax, mx_rule, row_amax=row_amax
        )
        if check_finite and bool(bad.any()):
            _raise_nonfinite("detected by the Triton kernel")
        block_scales = scale_bytes.view(torch.float8_e4m3fn) if fmt is Format.NVFP4 else scale_bytes
    else:
        if check_finite and not bool(torch.isfinite(x_MK).all()):
            _raise_nonfinite("detected before quantization")
        if fmt is Format.MXFP4:
            g = None
            codes, block_scales = reference.mxfp4_quantize_reference(x_MK, mx_rule, stochastic, key)
        else:
            if global_amax is not None:
                tensor_amax = global_amax.reshape(-1, 1) if row_scale else global_amax
            else:
                tensor_amax = x_MK.abs().amax(-1, keepdim=True) if row_scale else x_MK.abs().amax()
            g = reference.nvfp4_global_scale(tensor_amax)
            codes, block_scales = reference.nvfp4_quantize_reference(x_MK, g, stochastic, key)
        packed = pack_codes(codes)

    if g is not None:
        g = g.reshape(*lead, 1) if row_scale else g.reshape(())
    return QTensor(
        codes=packed.reshape(*lead, k // 2),
        block_scales=block_scales.reshape(*lead, k // fmt.block_size),
        global_scale=g,
        fmt=fmt,
        shape=torch.Size(x.shape),
    )


def quantize_rows_into(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       g: torch.Tensor, *, backend: str = "auto") -> None:
    """Row-scaled NVFP4 of the rows (token t, head h) of x, written into preallocated storage at
    row slots[t]: what a paged KV cache stores for new tokens. On the GPU one kernel does the
    quantization and the scatter; the values are `quantize(x, "nvfp4", scale="row")`'s.

    Args:
        x: bfloat16/float32 [n, H, K] (any strides, the last 1), K a multiple of 16, finite.
        slots: int64 [n], distinct. codes: uint8 [S, H, K/2]; scales: uint8 (E4M3 bits) [S, H,
            K/16]; g: float32 [S, H, 1]; all contiguous.
    """
    if x.dim() != 3 or slots.shape != (x.shape[0],):
        raise ValueError(f"quantize_rows_into: x must be [n, H, K] with slots [n], got {tuple(x.shape)} and "
                         f"{tuple(slots.shape)}")
    if _use_triton(x, backend):
        triton_fp4.quantize_rows_into_triton(x, slots.to(x.device), codes, scales, g)
        return
    q = quantize(x, "nvfp4", scale="row", backend="torch", check_finite=False)
    slots = slots.to(codes.device)
    codes[slots] = q.codes
    scales[slots] = q.block_scales.view(torch.uint8)
    g[slots] = q.global_scale


def fake_quantize_rows(
    x: torch.Tensor, *, capture: bool = False, backend: str = "auto", check_finite: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Row-scaled NVFP4 fake quantization of activation rows, in one kernel on the GPU, with
    what a dense guidance record keeps about the rounding when `capture`.

    Args:
        x: float32/bfloat16/float16 [R, K], K a multiple of 16.
        capture: also return the mantissa bits, block scales and global scales.
        check_finite: refuse NaN/Inf (one host synchronisation on the GPU).
    Returns:
        (dequantize(quantize(x, "nvfp4", scale="row"), x.dtype) [R, K],
         None, or (mantissa bits uint8 [R, K/8] = pack_bits(codes & 1),
                   block scale bytes uint8 [R, K/16], global scales float32 [R])).
    """
    _validate_input(x, Format.NVFP4)
    if x.dim() != 2:
        raise ValueError(f"fake_quantize_rows expects rows [R, K], got shape {tuple(x.shape)}")
    if _use_triton(x, backend):
        out, bits, scales, g, bad, _ = triton_fp4.fake_quantize_rows_triton(x.contiguous(), capture)
        if check_finite and bool(bad.any()):
            _raise_nonfinite("detected by the Triton kernel")
        return out, (bits, scales, g) if capture else None
    q = quantize(x, "nvfp4", scale="row", backend="torch", check_finite=check_finite)
    out = dequantize(q, x.dtype, backend="torch")
    if not capture:
        return out, None
    return out, (mantissa_bits(q.codes), q.block_scales.view(torch.uint8), q.global_scale.reshape(-1))


def _check_guidance_shapes(x: torch.Tensor, global_scale, block_scales, mantissa_bits) -> None:
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    want = {
        "global_scale": (global_scale, torch.float32, lead + (1,)),
        "block_scales": (block_scales, torch.float8_e4m3fn, lead + (k // 16,)),
        "mantissa_bits": (mantissa_bits, torch.uint8, lead + (k // 8,)),
    }
    for name, (t, dtype, shape) in want.items():
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"quantize_guided: {name} must be {dtype} {shape} for x of shape {tuple(x.shape)}, "
                             f"got {got}")
        if t.device != x.device:
            raise ValueError(f"quantize_guided: {name} is on {t.device}, x on {x.device}")


def _check_guidance_values(global_scale: torch.Tensor, block_scales: torch.Tensor) -> None:
    # Scales the quantizer can produce: g finite and positive, E4M3 bytes 1..0x7E (positive,
    # non-zero, not NaN). Anything else would be misapplied, differently by each backend.
    sb = block_scales.view(torch.uint8)
    g_ok = torch.isfinite(global_scale) & (global_scale > 0)
    if not bool(g_ok.all() & ((sb >= 1) & (sb <= 0x7E)).all()):
        what = "global_scale (must be finite and > 0)" if not bool(g_ok.all()) else \
            "block_scales (must be positive, non-zero, non-NaN E4M3)"
        raise ValueError(f"quantize_guided: {what} holds values the quantizer never produces")


def quantize_guided(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    block_scales: torch.Tensor,
    mantissa_bits: torch.Tensor,
    *,
    backend: str = "auto",
    check_finite: bool = True,
) -> QTensor:
    """NVFP4-quantize the trainer's `x` under the engine's scales and rounding decisions.

    The global and block scales are taken as given (never recomputed); each element gets the
    E2M1 code nearest to x / (s * g) whose mantissa bit is the engine's; the sign is x's;
    magnitudes saturate at 6 (docs/design.md 4.3).

    Args:
        x: float32/bfloat16/float16 [..., K], K a multiple of 16.
        global_scale: float32 [..., 1], the engine's row global scales.
        block_scales: float8_e4m3fn [..., K/16], the engine's block scales.
        mantissa_bits: uint8 [..., K/8], element 8j+i of a row in bit i of byte j
            (numpy.packbits(..., bitorder="little")).
    Returns:
        QTensor (row-scaled NVFP4) holding the guided codes and the given scales.
    Raises:
        ValueError: shapes, dtypes or devices that do not fit x; NaN or Inf in x; scales the
            quantizer never produces (with check_finite, which costs one host sync on the GPU).
    """
    _validate_input(x, Format.NVFP4)
    _check_guidance_shapes(x, global_scale, block_scales, mantissa_bits)
    if check_finite:
        _check_guidance_values(global_scale, block_scales)
    lead, k = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, k).contiguous()
    g_M1 = global_scale.reshape(-1, 1).contiguous()
    s_MB = block_scales.reshape(-1, k // 16).contiguous()
    bits_MP = mantissa_bits.reshape(-1, k // 8).contiguous()
    if _use_triton(x, backend):
        packed, bad = triton_fp4.quantize_guided_rows_triton(x_MK, g_M1.reshape(-1), s_MB.view(torch.uint8), bits_MP)
        if check_finite and bool(bad.any()):
            _raise_nonfinite("detected by the Triton kernel")
    else:
        if check_finite and not bool(torch.isfinite(x_MK).all()):
            _raise_nonfinite("detected before quantization")
        packed = pack_codes(reference.nvfp4_quantize_guided_reference(x_MK, g_M1, s_MB, unpack_bits(bits_MP)))
    return QTensor(packed.reshape(*lead, k // 2), block_scales, global_scale, Format.NVFP4, torch.Size(x.shape))


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32, *, backend: str = "auto") -> torch.Tensor:
    """Values of a QTensor: e2m1(code) * block_scale (* global_scale), in that order.

    Args:
        q: the quantized tensor.
        dtype: output dtype; values are computed in float32 and rounded once to `dtype`.
    Returns:
        `dtype` tensor of shape `q.shape`.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported output dtype {dtype}; use one of {SUPPORTED_DTYPES}")
    r = q.rows()
    g = r.global_scale
    if _use_triton(q.codes, backend):
        scale_bytes = r.block_scales.view(torch.uint8) if q.fmt is Format.NVFP4 else r.block_scales
        g_flat = None if g is None else (g.reshape(-1) if g.dim() else g)
        out = triton_fp4.dequantize_rows_triton(r.codes.contiguous(), scale_bytes.contiguous(), g_flat, q.fmt, dtype)
    elif q.fmt is Format.MXFP4:
        out = reference.mxfp4_dequantize_reference(unpack_codes(r.codes), r.block_scales).to(dtype)
    else:
        out = reference.nvfp4_dequantize_reference(unpack_codes(r.codes), r.block_scales, g).to(dtype)
    return out.reshape(q.shape)


# E2M1 would round magnitudes up to 7 (the midpoint to the next binade's 8) down to 6
# even without saturation; only beyond it does the clamp change the result.
CLIP_THRESHOLD = 7.0


def block_clip_bound(q: QTensor) -> torch.Tensor:
    """Per block, the magnitude above which saturation (not rounding) sets the value.

    7 * block_scale (* g), float32 [..., B]. Dynamic NVFP4 scales keep every element below it
    while the scale is an E4M3 normal (its rounding moves the block max to at most ~6.4 in
    scaled units). Below that they do not: a block whose max is under about 2^-6 / 448 of the
    global amax gets a subnormal scale (steps of 2^-9), and its max can saturate. Otherwise only
    scales given from outside (`global_amax`, guidance) clip.
    """
    r = q.rows()
    if q.fmt is Format.MXFP4:
        u = e8m0_to_float(r.block_scales)
    else:
        u = e4m3_to_float(r.block_scales) * r.global_scale
    return (CLIP_THRESHOLD * u).reshape(*q.shape[:-1], q.shape[-1] // q.block_size)  # explicit: 0 rows


def ste_mask(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """bool of x's shape: where the straight-through gradient passes, |x| < 7 * block scale * g
    (elements beyond were clipped; see `block_clip_bound`). q is x's quantization."""
    bound = block_clip_bound(q)
    xb = x.detach().float().reshape(*bound.shape, q.block_size)
    return (xb.abs() < bound.unsqueeze(-1)).reshape(x.shape)


class _FakeQuantizeSTE(torch.autograd.Function):
    """fake_fn(x) -> (fake-quantized x, STE mask or None, 0-d bool whether the mask is all true);
    the gradient passes where the mask is set (the mask is None only where no gradient is wanted),
    untouched once the mask is known to be all true (`ClipMask`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fake_fn) -> torch.Tensor:
        out, inside, all_inside = fake_fn(x.detach())
        ctx.save_for_backward(inside)
        ctx.clip = None if inside is None else ClipMask(inside, hold=False, all_inside=all_inside)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inside,) = ctx.saved_tensors
        # waits for the answer (an event of this forward's quantize, long queued: no drain of the
        # GPU's queue), which is nearly always "all true" and spares a pass over the gradient
        return (grad if ctx.clip.known_all_true(wait=True) else grad * inside), None


def _wants_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _fusable(x: torch.Tensor, backend: str) -> bool:
    """Whether x may take the one-pass BF16 fake quantization kernel (before its layout is checked)."""
    return x.dtype == torch.bfloat16 and _use_triton(x, backend)


def fake_quantize_ste(
    x: torch.Tensor,
    fmt: str | Format = "nvfp4",
    scale: str | None = None,
    rounding: str = "rne",
    seed: int | None = None,
    *,
    global_amax: torch.Tensor | None = None,
    mx_scale_rule: str | MXScaleRule = "floor",
    backend: str = "auto",
    check_finite: bool = True,
    with_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fake_quantize`'s values and straight-through mask, without autograd.

    BF16 NVFP4 with rounding="rne" on the Triton backend takes one kernel that reads x once and
    writes the values and the mask (`triton_fp4.fake_quantize_bf16_triton`); anything else
    quantizes, dequantizes and compares (`ste_mask`) in three steps. The results are the same.

    Args:
        x, fmt, scale, rounding, seed, global_amax, mx_scale_rule, backend, check_finite: as `quantize`.
        with_mask: compute the mask (else None is returned for it).
    Returns:
        (dequantize(quantize(x, ...), x.dtype) of x's shape and dtype, bool mask of x's shape or None).
    """
    return _fake_quantize_ste(x, fmt, scale, rounding, seed, global_amax=global_amax, mx_scale_rule=mx_scale_rule,
                              backend=backend, check_finite=check_finite, with_mask=with_mask, answer=False)[:2]


def fake_quantize_ste_flagged(x: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                           torch.Tensor]:
    """`fake_quantize_ste` (the same arguments), and whether its mask is all true: a 0-d bool
    tensor on x's device, given with or without the mask. The one-pass kernel answers it from
    per-program flags, without writing the mask where with_mask=False and without a second pass
    over it (`ClipMask` takes the answer)."""
    return _fake_quantize_ste(x, *args, answer=True, **kwargs)


def _fake_quantize_ste(x, fmt="nvfp4", scale=None, rounding="rne", seed=None, *, global_amax=None,
                       mx_scale_rule="floor", backend="auto", check_finite=True, with_mask=True, answer=True):
    """`fake_quantize_ste_flagged`; without `answer` the all-true answer is None (the three-step
    path then makes no mask it does not return)."""
    if rounding == "rne" and _parse_format(fmt) is Format.NVFP4 and _fusable(x, backend):
        _validate_input(x, Format.NVFP4)
        x_MK = x.reshape(-1, x.shape[-1]).contiguous()
        if triton_fp4.fusable(x_MK):
            _, row_scale, given = _check_quantize_args(x, fmt, scale, rounding, seed, global_amax, check_finite)
            if not row_scale and given is None:
                given = amax(x_MK)
            return _fused_result(x, check_finite, *triton_fp4.fake_quantize_bf16_triton(
                x_MK, row_scale, None if row_scale else given, given.reshape(-1) if row_scale and given is not None
                else None, with_mask=with_mask, with_answer=answer))
    q = quantize(x, fmt, scale, rounding, seed, global_amax=global_amax, mx_scale_rule=mx_scale_rule,
                 backend=backend, check_finite=check_finite)
    return _three_step_result(x, q, backend, with_mask, answer)


def _three_step_result(x, q, backend, with_mask, answer) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                  torch.Tensor | None]:
    mask = ste_mask(x, q) if with_mask or answer else None
    return (dequantize(q, x.dtype, backend=backend), mask if with_mask else None,
            mask.all() if answer else None)


def _fused_result(x, check_finite, out, mask, _scales, _g, bad, all_inside) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`fake_quantize_bf16_triton`'s values, mask and all-true answer, in x's shape, its
    non-finite flags checked."""
    if check_finite and bool(bad.any()):
        _raise_nonfinite("detected by the Triton kernel")
    return out.reshape(x.shape), None if mask is None else mask.reshape(x.shape), all_inside


def fake_quantize_guided_ste(x: torch.Tensor, global_scale: torch.Tensor, block_scales: torch.Tensor,
                             mantissa_bits: torch.Tensor, *, backend: str = "auto", check_finite: bool = True,
                             with_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fake_quantize_guided`'s values and straight-through mask, without autograd; one kernel
    for BF16 x on the Triton backend, as `fake_quantize_ste`. Arguments as `quantize_guided`.

    Returns:
        (dequantize(quantize_guided(x, ...), x.dtype), bool mask of x's shape or None).
    """
    return _fake_quantize_guided_ste(x, global_scale, block_scales, mantissa_bits, backend=backend,
                                     check_finite=check_finite, with_mask=with_mask, answer=False)[:2]


def _fake_quantize_guided_ste(x, global_scale, block_scales, mantissa_bits, *, backend="auto",
                              check_finite=True, with_mask=True, answer=True):
    """`fake_quantize_guided_ste` and (with `answer`) whether the mask is all true, as
    `fake_quantize_ste_flagged`."""
    if _fusable(x, backend):
        _validate_input(x, Format.NVFP4)
        _check_guidance_shapes(x, global_scale, block_scales, mantissa_bits)
        k = x.shape[-1]
        x_MK = x.reshape(-1, k).contiguous()
        bits_MP = mantissa_bits.reshape(-1, k // 8).contiguous()
        if triton_fp4.fusable(x_MK, bits_MP):
            if check_finite:
                _check_guidance_values(global_scale, block_scales)
            guidance = (global_scale.reshape(-1).contiguous(),
                        block_scales.reshape(-1, k // 16).contiguous().view(torch.uint8), bits_MP)
            return _fused_result(x, check_finite,
                                 *triton_fp4.fake_quantize_bf16_triton(x_MK, guidance=guidance, with_mask=with_mask,
                                                                       with_answer=answer))
    q = quantize_guided(x, global_scale, block_scales, mantissa_bits, backend=backend, check_finite=check_finite)
    return _three_step_result(x, q, backend, with_mask, answer)


def fake_quantize(x: torch.Tensor, fmt: str | Format = "nvfp4", scale: str | None = None,
                  rounding: str = "rne", seed: int | None = None, **kwargs) -> torch.Tensor:
    """quantize then dequantize back to x.dtype, with a straight-through backward.

    The gradient passes unchanged where the element was rounded and is zero where it was
    clipped: |x| >= 7 * block scale * g, beyond the rounding range of the largest code 6
    (see `block_clip_bound`). Arguments as `quantize`; BF16 NVFP4 RNE on the GPU is one pass
    (`fake_quantize_ste`).

    Returns:
        tensor of x's shape and dtype.
    """
    with_mask = _wants_grad(x)

    def fake_fn(t):
        return _fake_quantize_ste(t, fmt, scale, rounding, seed, with_mask=with_mask, answer=with_mask, **kwargs)

    return _FakeQuantizeSTE.apply(x, fake_fn)


def fake_quantize_guided(x: torch.Tensor, global_scale: torch.Tensor, block_scales: torch.Tensor,
                         mantissa_bits: torch.Tensor, **kwargs) -> torch.Tensor:
    """`quantize_guided` then dequantize to x.dtype, with the straight-through backward of
    `fake_quantize` (zero gradient where x clipped under the given scales). Shapes as
    `quantize_guided`; returns x's shape and dtype."""
    with_mask = _wants_grad(x)

    def fake_fn(t):
        return _fake_quantize_guided_ste(t, global_scale, block_scales, mantissa_bits, with_mask=with_mask,
                                         answer=with_mask, **kwargs)

    return _FakeQuantizeSTE.apply(x, fake_fn)
