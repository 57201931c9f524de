"""The BF16 quantize kernel's exact thresholds against FP32 division (see triton_fp4.py).

For a block divisor u, `_rne_thresholds` / `_guided_thresholds` give BF16 values C with
|x| >= C  <=>  the spec's comparison of fl(|x| / u) with a grid midpoint holds. Checked here for
every positive finite BF16 x against torch's IEEE FP32 division, for divisors across the whole
FP32 range (subnormal, tie-prone ones with few significant bits, random ones), under the
Triton interpreter (the GPU's packed-BF16 path is compared bit for bit by bench/fp4_quantize.py).
"""

import torch
import triton
import triton.language as tl

from trace_kernels.fp4 import triton_fp4 as T


@triton.jit
def _thresholds_kernel(u_ptr, out_ptr, N: tl.constexpr, GUIDED: tl.constexpr):
    i = tl.arange(0, N)
    u = tl.load(u_ptr + i)
    if GUIDED:
        c1, c2, c3, c4, c5, c6 = T._guided_thresholds(u, True)
        ts = (c1, c2, c3, c4, c5, c6)
    else:
        c1, c2, c3, c4, c5, c6, c7 = T._rne_thresholds(u, True)
        tl.store(out_ptr + i * 7 + 6, c7)
        ts = (c1, c2, c3, c4, c5, c6)
    for q in tl.static_range(6):
        tl.store(out_ptr + i * (6 if GUIDED else 7) + q, ts[q])


def _divisors() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    few_bits = torch.tensor([m * 2.0**e for m in (1, 3, 5, 7, 9, 13, 15) for e in range(-140, 120, 19)])
    rand = torch.exp2(torch.empty(60).uniform_(-149, 125, generator=g)) * torch.empty(60).uniform_(1, 2, generator=g)
    subnormal = torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-127 * 1.5, 2.0**-126 * (1 - 2.0**-23)])
    u = torch.cat([few_bits, rand, subnormal]).float()
    u = u[(u > 0) & torch.isfinite(u)]
    n = triton.next_power_of_2(u.numel())
    return torch.cat([u, torch.ones(n - u.numel())])


def _thresholds(u: torch.Tensor, guided: bool) -> torch.Tensor:
    k = 6 if guided else 7
    out = torch.empty(u.numel() * k, dtype=torch.int32)
    _thresholds_kernel[(1,)](u, out, N=u.numel(), GUIDED=guided)
    return (out.reshape(-1, k) & 0xFFFF).to(torch.int32)  # the low half; both halves are equal


def test_thresholds_equal_fp32_division_for_every_bf16():
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)  # every positive finite BF16
    x = bits.to(torch.int16).view(torch.bfloat16).float()
    u = _divisors()
    rne, guided = _thresholds(u, False), _thresholds(u, True)
    for j in range(u.numel()):
        v = x / torch.full_like(x, u[j].item())  # IEEE FP32 division, as the reference
        want_rne = torch.stack([v > 0.25, v >= 0.75, v > 1.25, v >= 1.75, v > 2.5, v >= 3.5, v > 5.0], 1)
        want_guided = torch.stack([v > 0.5, v > 1.5, v > 3.0, v > 1.0, v > 2.0, v > 4.0], 1)
        assert torch.equal(bits[:, None] >= rne[j][None, :], want_rne), f"u = {u[j].item()!r}"
        assert torch.equal(bits[:, None] >= guided[j][None, :], want_guided), f"u = {u[j].item()!r}"
