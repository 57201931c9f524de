"""An independent float64 re-derivation of docs/design.md section 2, in numpy and ml_dtypes.

It shares no code with `trace_kernels`. FP32 steps are computed in float64 and rounded once
to float32: for +, -, *, / of float32 operands this is the correctly rounded FP32 result
(53 >= 2 * 24 + 2, so double rounding is innocuous). E4M3 rounding is ml_dtypes'; E2M1
rounding is nearest-on-the-grid with ties to the even code, by search over the grid.
"""

import math

import ml_dtypes
import numpy as np

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def f32(a):
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def e2m1_rne(v):
    """Codes 0..15 of float32 values v (numpy), ties to even, saturating, sign kept at zero."""
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.abs(v), 6.0)
    dist = np.abs(a[..., None] - GRID)
    best = dist.min(-1, keepdims=True)
    cand = dist == best
    # Among equally near grid points prefer the even code (mantissa bit 0).
    even = cand & (np.arange(8) % 2 == 0)
    mag = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))
    return (mag + 8 * np.signbit(v)).astype(np.uint8)


def nvfp4(x, row_scale, global_amax=None):
    """Returns (codes [M,K] uint8, scales float32 [M,B], g float64 [M,1] or scalar)."""
    x = np.asarray(x, dtype=np.float64)
    m, k = x.shape
    if row_scale:
        amax = np.abs(x).max(-1, keepdims=True)
    else:
        amax = np.float64(np.abs(x).max() if global_amax is None else global_amax)
    g = f32(amax / 2688.0)
    g = np.where(g == 0, 1.0, g)
    t = f32(6.0 * g)
    xb = x.reshape(m, k // 16, 16)
    bamax = np.abs(xb).max(-1)
    s = np.clip(f32(bamax / (t if np.ndim(t) == 0 else t)), 2.0**-9, 448.0)
    s = s.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.where(bamax == 0, 1.0, s)
    u = f32(s * (g if np.ndim(g) == 0 else g))
    v = f32(xb / u[..., None])
    return e2m1_rne(v).reshape(m, k), s.astype(np.float32), g


def mx_exponent(amax, rule):
    if amax == 0:
        return 0
    if rule == "floor":
        e = math.frexp(amax)[1] - 1 - 2
    else:
        a = float(f32(amax / 6.0))
        m, ex = math.frexp(a)  # a = m * 2**ex, m in [0.5, 1)
        e = ex - 1 if m == 0.5 else ex
    return min(max(e, -127), 127)


def mxfp4(x, rule="floor"):
    """Returns (codes [M,K] uint8, scale bytes [M,B] uint8)."""
    x = np.asarray(x, dtype=np.float64)
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    e = np.vectorize(lambda a: mx_exponent(float(a), rule))(np.abs(xb).max(-1)).astype(np.int64)
    v = f32(xb / np.ldexp(1.0, e)[..., None])
    return e2m1_rne(v).reshape(m, k), (e + 127).astype(np.uint8)
