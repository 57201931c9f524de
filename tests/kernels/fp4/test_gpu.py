"""The Triton kernels on a real GPU against the torch reference on the CPU, on large tensors.

Needs CUDA: run on the GPU machine (bench/results/ records the runs); CI has no GPU and runs
the same kernels under the interpreter in test_fp4_quantize.py.
"""

import pytest
import torch

from tests.support.fp4 import assert_bitwise_equal, assert_same_qtensor, heavy_tailed
from trace_kernels.fp4 import dequantize, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [("nvfp4", "tensor"), ("nvfp4", "row"), ("mxfp4", None)]


def extreme_rows(m, k, seed):
    """Heavy tails plus rows and blocks spanning float32's range, zeros and subnormal scales."""
    x = heavy_tailed(m, k, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x *= torch.exp2(torch.randint(-60, 60, (m, 1), generator=g).float())
    x[::97] = 0.0
    x[1::13, :64] *= 2.0**-24
    x[5::101] = heavy_tailed(len(range(5, m, 101)), k, seed=seed + 1) * 2.0**-130  # subnormal g, MX 2**-127
    return x


@pytest.mark.parametrize("fmt, scale", CASES)
@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
@pytest.mark.parametrize("shape, dtype", [((4096, 8192), torch.bfloat16), ((3000, 5120), torch.float32),
                                          ((64, 65536), torch.bfloat16)])
def test_gpu_kernel_equals_cpu_reference(fmt, scale, rounding, shape, dtype):
    x = extreme_rows(*shape, seed=shape[0]).to(dtype)
    if dtype == torch.bfloat16:  # bf16 keeps float32's exponent range, subnormals included
        assert 0 < float(x[5].abs().max()) < 2.0**-120
    seed = 1234 if rounding == "stochastic" else None
    ref = quantize(x, fmt, scale, rounding, seed, backend="torch")
    gpu = quantize(x.cuda(), fmt, scale, rounding, seed, backend="triton").to("cpu")
    assert_same_qtensor(ref, gpu)
    assert_bitwise_equal(dequantize(ref, dtype, backend="torch"),
                         dequantize(gpu.to("cuda"), dtype, backend="triton").cpu())


def test_gpu_reference_path_equals_cpu_reference():
    """The torch reference itself gives the same bytes on the GPU as on the CPU."""
    x = extreme_rows(1024, 4096, seed=5).bfloat16()
    for fmt, scale in CASES:
        assert_same_qtensor(quantize(x, fmt, scale, backend="torch"),
                            quantize(x.cuda(), fmt, scale, backend="torch").to("cpu"))


def test_gpu_rejects_nonfinite():
    x = torch.randn(256, 1024, device="cuda")
    x[100, 7] = float("nan")
    for fmt, scale in CASES:
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize(x, fmt, scale)


@pytest.mark.parametrize("shape, dtype", [((4096, 8192), torch.bfloat16), ((3000, 5120), torch.float32)])
def test_gpu_guided_kernel_equals_cpu_reference(shape, dtype):
    from trace_kernels.fp4 import pack_bits, quantize_guided, unpack_codes

    x_e = extreme_rows(*shape, seed=7).to(dtype)
    q_e = quantize(x_e, scale="row", backend="torch")
    bits = pack_bits(unpack_codes(q_e.codes) & 1)
    drift = 1 + (torch.rand(shape, generator=torch.Generator().manual_seed(8)) - 0.5) * 2**-6
    x_t = (x_e.float() * drift).to(dtype)
    ref = quantize_guided(x_t, q_e.global_scale, q_e.block_scales, bits, backend="torch")
    gpu = quantize_guided(x_t.cuda(), q_e.global_scale.cuda(), q_e.block_scales.cuda(), bits.cuda(), backend="triton")
    assert_same_qtensor(ref, gpu.to("cpu"))


@pytest.mark.parametrize("shape", [(4096, 2048), (64, 65536)])  # one program per row; long rows
def test_gpu_fused_fake_quantize_equals_cpu_reference(shape):
    """The fused quantize + dequantize + capture kernel against the CPU torch path, bit for bit."""
    from trace_kernels.fp4 import fake_quantize_rows

    x = extreme_rows(*shape, seed=3).bfloat16()
    want, want_kept = fake_quantize_rows(x, capture=True, backend="torch")
    got, got_kept = fake_quantize_rows(x.cuda(), capture=True)
    assert_bitwise_equal(got.cpu(), want)
    (bits, scales, g), (want_bits, want_scales, want_g) = got_kept, want_kept
    assert torch.equal(bits.cpu(), want_bits) and torch.equal(scales.cpu(), want_scales)
    assert_bitwise_equal(g.cpu(), want_g)
