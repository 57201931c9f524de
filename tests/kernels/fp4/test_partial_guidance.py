"""Partial guidance (sparse records): the one-pass BF16 kernel against the torch definition (on a
GPU where there is one, else under TRITON_INTERPRET=1), and the definition against plain
round-to-nearest where the guidance leaves everything open."""

import pytest
import torch

from tests.support.fp4 import e2m1_sweep, heavy_tailed, triton_device
from trace_kernels.fp4 import (
    fake_quantize,
    fake_quantize_guided,
    fake_quantize_partly_guided,
    mantissa_bits,
    quantize,
    resolve_partial,
    triton_fp4,
)
from trace_kernels.fp4.triton_fp4 import MAX_ROW_ELEMENTS

SCALE_CODINGS = ["given", "lsb", "known"]  # in the order of triton_fp4's SCALES_* rules


def _rows(k: int) -> torch.Tensor:
    """BF16 rows: heavy-tailed, a spread of E2M1 magnitudes and ties, an all-zero block, tiny values
    (subnormal block scales), and rows the engine's scales make clip."""
    sweep = torch.from_numpy(e2m1_sweep())
    sweep = sweep[torch.linspace(0, len(sweep) - 1, k).long()]
    rows = [heavy_tailed(4, k, seed=5), sweep.reshape(1, k) * 0.37, heavy_tailed(1, k, seed=6) * 1e-6,
            heavy_tailed(2, k, seed=7)]
    x = torch.cat(rows)
    x[0, :16] = 0
    return x.to(torch.bfloat16)


def _engine(x: torch.Tensor):
    """The engine's guidance for rows it computed slightly differently (the last two rows 30%
    smaller, so the trainer's values clip under the engine's scales)."""
    drift = 1 + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    xe = (x.float() * drift)
    xe[-2:] /= 1.3
    q = quantize(xe.to(torch.bfloat16), "nvfp4", scale="row")
    r, k = x.shape
    return q.global_scale.reshape(r, 1), q.block_scales.view(torch.uint8).reshape(r, k // 16), mantissa_bits(q.codes)


def _partial(x, scale_coding, bits_known):
    r, k = x.shape
    gen = torch.Generator().manual_seed(9)
    return dict(scale_lsb=scale_coding == "lsb",
                scale_known=(torch.rand(r, k // 16, generator=gen) < 0.5) if scale_coding == "known" else None,
                bit_known=torch.randint(0, 256, (r, k // 8), generator=gen, dtype=torch.uint8) if bits_known else None)


# rows of up to MAX_ROW_ELEMENTS run one program a row; longer rows run in tiles of blocks
CASES = [(coding, bits_known, 64) for coding in SCALE_CODINGS for bits_known in (False, True)]
CASES += [("lsb", True, MAX_ROW_ELEMENTS + 32), ("known", True, MAX_ROW_ELEMENTS + 32)]


@pytest.mark.parametrize("scale_coding, bits_known, k", CASES)
def test_the_one_pass_kernel_gives_the_torch_definitions_values_and_gradient(scale_coding, bits_known, k, monkeypatch):
    """On the GPU where there is one, else under TRITON_INTERPRET=1 (tests/conftest.py)."""
    x = _rows(k)
    g, scales, bits = _engine(x)
    partial = _partial(x, scale_coding, bits_known)
    want_x = x.clone().requires_grad_()
    want = fake_quantize_guided(want_x, *resolve_partial(x, g, scales, bits, **partial), backend="torch")
    want.backward(torch.ones_like(want))
    assert not bool(want_x.grad.all()), "some trainer values should clip under the engine's scales"
    dev = triton_device()
    got_x = x.to(dev).requires_grad_()
    on_dev = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in partial.items()}
    launches = []
    kernel = triton_fp4.fake_quantize_partly_guided_bf16_triton
    monkeypatch.setattr(triton_fp4, "fake_quantize_partly_guided_bf16_triton",
                        lambda *a, **kw: launches.append(a[4]) or kernel(*a, **kw))
    got = fake_quantize_partly_guided(got_x, g.to(dev), scales.to(dev), bits.to(dev), backend="triton", **on_dev)
    got.backward(torch.ones_like(got))
    assert launches == [SCALE_CODINGS.index(scale_coding)]  # one pass, under the coding's SCALE_RULE
    assert torch.equal(got.cpu().view(torch.int16), want.detach().view(torch.int16))
    assert torch.equal(got_x.grad.cpu(), want_x.grad)


@pytest.mark.parametrize("scale_coding", ["lsb", "known"])
def test_guidance_that_leaves_everything_open_is_round_to_nearest(scale_coding):
    """Scales given nowhere (or only their own last bits) and no mantissa bit given: the rows'
    own RNE quantization, as `fake_quantize` computes it."""
    x = heavy_tailed(6, 64, seed=11).to(torch.bfloat16)
    own = quantize(x, "nvfp4", scale="row")
    g, scales = own.global_scale.reshape(6, 1), own.block_scales.view(torch.uint8).reshape(6, 4)
    noise = torch.randint(0, 256, (6, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(12))
    lsb = scales if scale_coding == "lsb" else noise.reshape(6, 8)[:, :4] | 1  # other scales, never applied
    known = None if scale_coding == "lsb" else torch.zeros(6, 4, dtype=torch.bool)
    got = fake_quantize_partly_guided(x, g, lsb, noise, scale_lsb=scale_coding == "lsb", scale_known=known,
                                      bit_known=torch.zeros(6, 8, dtype=torch.uint8), backend="torch")
    assert torch.equal(got.view(torch.int16), fake_quantize(x, "nvfp4", scale="row").view(torch.int16))


def test_partial_guidance_that_does_not_fit_is_refused():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    g, s, b = torch.ones(2, 1), torch.full((2, 2), 0x38, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"bit_known must be torch.uint8 \(2, 4\)"):
        resolve_partial(x, g, s, b, bit_known=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale_lsb and scale_known are two codings"):
        fake_quantize_partly_guided(x, g, s, b, scale_lsb=True, scale_known=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="not whole 16-element blocks"):
        resolve_partial(torch.zeros(2, 24), g, s, b)
