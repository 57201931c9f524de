"""`ClipMask`: when the host learns that a straight-through mask is all true (no stream sync)."""

import pytest
import torch

from tests.support.fp4 import EVENT_PATH_DEVICES as DEVICES
from tests.support.fp4 import triton_device
from trace_kernels.fp4 import ClipMask, fake_quantize
from trace_kernels.fp4.api import quantize, ste_mask


@pytest.mark.parametrize("device", DEVICES)
def test_an_all_true_mask_is_dropped_once_known_and_a_clipping_one_is_kept(device):
    inside = torch.ones(3, 5, dtype=torch.bool, device=device)
    held = ClipMask(inside)
    assert held.get(wait=True) is None and held.known_all_true()
    inside[1, 2] = False
    clipping = ClipMask(inside)
    assert not clipping.known_all_true(wait=True) and clipping.get() is inside
    assert torch.equal(clipping.part(1).get(), inside[1]) and clipping.part(0).get().all()
    unheld = ClipMask(inside, hold=False)
    assert unheld.get(wait=True) is None and not unheld.known_all_true()


@pytest.mark.parametrize("device", DEVICES)
def test_a_mask_not_written_is_made_once_and_only_where_the_answer_is_no(device):
    made = []

    def remake():
        made.append(1)
        return inside

    inside = torch.ones(3, 5, dtype=torch.bool, device=device)
    inside[2, 0] = False
    unwritten = ClipMask(None, all_inside=inside.all(), remake=remake)
    assert unwritten.get() is inside and unwritten.part(2).get() is not None and made == [1]  # get waits
    assert torch.equal(unwritten.part(2).get(), inside[2]) and made == [1]
    fine = ClipMask(None, all_inside=torch.ones((), dtype=torch.bool, device=device), remake=remake)
    assert fine.get() is None and fine.known_all_true() and made == [1]
    with pytest.raises(ValueError, match="needs its answer"):
        ClipMask(None, all_inside=inside.all())


@pytest.mark.parametrize("device", DEVICES)
def test_fake_quantize_knows_when_nothing_clipped_and_its_gradient_is_the_reference_masks(device):
    """Rows scaled by their own amax do not clip (the backward may skip the mask); a global amax a
    quarter of the rows' clips their largest elements (the backward applies the mask)."""
    dev = triton_device() if device == "cuda" else "cpu"
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(8, 64, generator=g) * torch.exp(torch.randn(8, 1, generator=g))).bfloat16()
    grad = torch.randn(8, 64, generator=g).bfloat16()
    low = x.float().abs().amax() / 4
    for kw, clips in ((dict(scale="row"), False), (dict(global_amax=low), True)):
        want_mask = ste_mask(x, quantize(x, **kw, backend="torch"))
        assert bool((~want_mask).any()) == clips
        xd = x.to(dev, copy=True).requires_grad_(True)
        y = fake_quantize(xd, check_finite=False, **{k: v.to(dev) if torch.is_tensor(v) else v for k, v in kw.items()})
        y.grad_fn.clip.settle(wait=True)
        assert y.grad_fn.clip.known_all_true() == (not clips)
        y.backward(grad.to(dev))
        assert torch.equal(xd.grad.cpu(), grad * want_mask)


def test_dynamic_scales_clip_only_in_blocks_whose_scale_is_an_e4m3_subnormal():
    """Why a mask is almost always all true, and why it is still kept: with the row's own amax,
    a block's scale rounds by at most 1/16 while it is an E4M3 normal (>= 2^-6), so the block max
    stays under 7 units; among the subnormals the step is 2^-9 and a block max of 1.4 steps
    saturates. Swept over block maxima from the row's amax down to about 2^-21 of it."""
    from trace_kernels.fp4 import e4m3_to_float

    fractions = torch.logspace(0, -11, 2000, base=2.0, dtype=torch.float64) ** 1.9  # 1 .. ~2^-21
    x = torch.ones(len(fractions), 32, dtype=torch.float64)
    x[:, 16:] = fractions[:, None] * torch.linspace(0.5, 1, 16, dtype=torch.float64)  # second block's max: fraction
    x = x.bfloat16()
    q = quantize(x, scale="row", backend="torch")
    mask = ste_mask(x, q).reshape(-1, 2, 16).all(-1)
    scale = e4m3_to_float(q.rows().block_scales).reshape(-1, 2)
    assert bool(mask[:, 0].all())  # the block holding the amax
    normal = scale[:, 1] >= 2.0**-6
    assert bool(normal.any()) and bool(mask[normal, 1].all())
    assert not bool(mask[~normal, 1].all())  # some subnormal-scale blocks clip
