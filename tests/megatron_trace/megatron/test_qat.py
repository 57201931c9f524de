"""One FP4 site's weight quantization: the per-step cache against the direct path."""

import pytest
import torch

from megatron_trace.megatron.qat import FP4Site, cached_weights
from megatron_trace.modes import TrainerPrecision
from trace_kernels.fp4 import amax, dequantize, quantize


def _weights(seed=0, shapes=((64, 48), (64, 48), (64, 48))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(*s, generator=g) * torch.exp(torch.randn(1, s[1], generator=g))).bfloat16())
            for s in shapes]


def test_weight_fake_quant_is_the_spec_and_its_cache_changes_nothing():
    site = FP4Site(name="qkv", layer=0, precision=TrainerPrecision.FP4_RNE)
    (w,) = _weights(shapes=((64, 48),))
    direct = site.quantize_weight(w)
    assert torch.equal(direct, dequantize(quantize(w.detach()), torch.bfloat16))  # one g over the tensor
    upstream = torch.randn(64, 48).bfloat16()
    (direct * upstream).sum().backward()
    g_direct, w.grad = w.grad.clone(), None
    with cached_weights():
        for _ in range(2):  # two micro-batches: quantized once, gradients accumulate
            cached = site.quantize_weight(w)
            assert torch.equal(cached, direct)
            (cached * upstream).sum().backward()
    assert torch.equal(w.grad, 2 * g_direct)


def test_expert_weights_get_one_global_scale_each_cached_or_not():
    site = FP4Site(name="fc2", layer=0, precision=TrainerPrecision.FP4_RNE, all_experts=True)
    ws = _weights(seed=1)
    direct = site.quantize_expert_weights(ws)
    for i, w in enumerate(ws):
        assert torch.equal(direct[i], dequantize(quantize(w.detach()), torch.bfloat16))
    upstream = torch.randn(direct.shape).bfloat16()
    (direct * upstream).sum().backward()
    grads = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    with cached_weights():
        cached = site.quantize_expert_weights(ws)
        assert torch.equal(cached, direct)
        (cached * upstream).sum().backward()
        assert all(torch.equal(w.grad, g) for w, g in zip(ws, grads, strict=True))
        with torch.no_grad():
            ws[1].mul_(2)  # an in-place update inside the scope is seen
        again = site.quantize_expert_weights(ws)
        assert torch.equal(again[1], dequantize(quantize(ws[1].detach()), torch.bfloat16))
        assert not torch.equal(again[1], cached[1])


def test_bf16_sites_leave_weights_alone():
    site = FP4Site(name="proj", layer=0)
    (w,) = _weights(shapes=((32, 32),))
    assert site.quantize_weight(w) is w


def test_the_cache_knows_a_weight_by_its_memory_not_by_the_object_passed():
    """TE's quantizers get `weight.detach()`, a new object per call whose id a freed alias of
    another expert soon had: each expert must still get its own weight, and an alias of a
    weight already quantized in the scope must find it."""
    site = FP4Site(name="fc1", layer=0, precision=TrainerPrecision.FP4_RNE)
    ws = _weights(seed=2, shapes=((64, 48),) * 4)
    want = [dequantize(quantize(w.detach()), torch.bfloat16) for w in ws]
    with cached_weights(), torch.no_grad():
        first = [site.quantize_weight(w.detach()) for w in ws]
        again = [site.quantize_weight(w.detach()) for w in ws]
        assert all(torch.equal(a, b) for a, b in zip(first, want, strict=True))
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, again, strict=True))  # quantized once
        ws[0].mul_(2)  # an update through the parameter reaches its aliases' version counter
        assert torch.equal(site.quantize_weight(ws[0].detach()), dequantize(quantize(ws[0].detach()), torch.bfloat16))


def test_one_pass_amax_equals_abs_amax_nan_included():
    """`amax` replaced `t.abs().amax()` (which writes a full-size copy first): same values,
    NaN propagating, for rows, experts and the whole tensor."""
    w = torch.randn(3, 8, 32).bfloat16()
    w[1, 2, 5] = float("nan")
    w[2, 0, 0] = float("-inf")
    for dim, keepdim in ((None, False), (-1, True), ((1, 2), False)):
        want = w.abs().amax() if dim is None else w.abs().amax(dim, keepdim=keepdim)
        got = amax(w, dim, keepdim)
        assert got.dtype == torch.float32
        assert torch.equal(got.isnan(), want.float().isnan())
        assert torch.equal(got.nan_to_num(), want.float().nan_to_num())


def test_expert_weights_quantized_at_once_are_found_expert_by_expert():
    """TE's grouped linear asks for each expert's weight alone: after the stacked pass each one
    is found in the cache (a slice of the stacked result, not quantized again) with the values
    of quantizing it alone; an expert updated since is quantized again."""
    site = FP4Site(name="fc1", layer=0, precision=TrainerPrecision.FP4_RNE, all_experts=True)
    ws = _weights(seed=3, shapes=((64, 48),) * 3)
    with cached_weights(), torch.no_grad():
        stacked = site.quantize_expert_weights(ws)
        for i, w in enumerate(ws):
            alone = site.quantize_weight(w.detach())
            assert torch.equal(alone, dequantize(quantize(w.detach()), torch.bfloat16))
            assert alone.data_ptr() == stacked[i].data_ptr()
        ws[2].mul_(3)
        again = site.quantize_weight(ws[2].detach())
        assert torch.equal(again, dequantize(quantize(ws[2].detach()), torch.bfloat16))
        assert again.data_ptr() != stacked[2].data_ptr()


def _recording(compute, calls: list):
    """compute(t, with_mask), noting each call's with_mask in `calls`."""
    return lambda t, with_mask: calls.append(with_mask) or compute(t, with_mask)


def test_the_cache_writes_no_mask_and_computes_one_only_where_a_weight_clips():
    """A weight scaled by its own amax (no block of subnormal scale here) does not clip: the cache
    quantizes it once without a mask and the backward hands the gradient on untouched; under a
    scale that clips (a global amax 4x below the weight's) the mask is computed once, by the
    backward, and the clipped elements get no gradient; a weight changed in place before that
    backward is refused."""
    from megatron_trace.megatron import qat
    from trace_kernels.fp4 import fake_quantize_ste_flagged

    (w,) = _weights(seed=2, shapes=((64, 48),))
    upstream = torch.randn(64, 48).bfloat16()
    site = FP4Site(name="proj", layer=0, precision=TrainerPrecision.FP4_RNE)
    with cached_weights():
        (site.quantize_weight(w) * upstream).sum().backward()
        (entry,) = qat._weight_cache.values()
        assert entry[2].get() is None
    assert torch.equal(w.grad, upstream)
    w.grad = None
    low = amax(w.detach()) / 4
    calls = []
    compute = _recording(lambda t, with_mask: fake_quantize_ste_flagged(
        t, "nvfp4", global_amax=low, check_finite=False, with_mask=with_mask), calls)
    with cached_weights():
        w_q = qat._cached([w], compute)
        (w_q * upstream).sum().backward()
        (qat._cached([w], compute) * upstream).sum().backward()
        (entry,) = qat._weight_cache.values()
        mask = entry[2].get()
    assert calls == [False, True]  # quantized without the mask; the mask made once, for the first backward
    # the largest block scale (448) reaches 6 * 448 * g = low (g = low / 2688); past 7/6 of it, values saturate
    clipped = w.detach().abs() > 7 * low / 6
    assert mask is not None and bool(clipped.any()) and not bool(clipped.all())
    assert torch.equal(w.grad[clipped], torch.zeros_like(w.grad[clipped]))
    assert torch.equal(w.grad[~mask], torch.zeros_like(w.grad[~mask]))
    assert torch.equal(w.grad[mask], 2 * upstream[mask])
    with cached_weights():
        w_q = qat._cached([w], compute)
        with torch.no_grad():
            w.mul_(2)
        with pytest.raises(RuntimeError, match="changed in place between its forward and its backward"):
            (w_q * upstream).sum().backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned copy behind an event needs a GPU"))])
def test_stacked_experts_each_get_their_slice_of_a_mask_made_only_because_one_clipped(device):
    """Experts quantized at once under a scale that clips one of them: the all-true answer comes
    later (a GPU event, not a stream sync) and is no, so the backward makes the stacked mask once;
    each expert gets its slice: the others' gradients pass untouched, the clipped one's are zero
    where it clipped."""
    from megatron_trace.megatron import qat
    from trace_kernels.fp4 import fake_quantize_ste_flagged

    ws = [w.to(device).detach().requires_grad_() for w in _weights(seed=3, shapes=((32, 48),) * 3)]
    with torch.no_grad():
        ws[1].mul_(8)  # expert 1 far above the shared global amax below: it clips, 0 and 2 do not
    low = torch.maximum(amax(ws[0]), amax(ws[2])).reshape(1, 1).expand(3, 1).contiguous()
    upstream = torch.randn(3, 32, 48).bfloat16().to(device)
    calls = []
    compute = _recording(lambda t, with_mask: fake_quantize_ste_flagged(
        t.reshape(3, -1), "nvfp4", scale="row", global_amax=low, check_finite=False, with_mask=with_mask), calls)
    with cached_weights():
        stacked = qat._cached(ws, compute, each=True)
        again = qat._cached([ws[0]], lambda t, with_mask: pytest.fail("expert 0 is cached already"))
        (stacked * upstream).sum().backward()
        (again * upstream[0]).sum().backward()
        parts = [qat._weight_cache[(qat._memory_key(w),)][2] for w in ws]
    assert calls == [False, True]
    mask = parts[1].get()
    clipped = ws[1].detach().abs() > 7 * low[1, 0] / 6
    assert bool(parts[0].get().all()) and bool(parts[2].get().all())  # slices of the one stacked mask
    assert mask is not None and bool(clipped.any()) and not bool(mask[clipped].any())
    assert torch.equal(ws[0].grad, 2 * upstream[0]) and torch.equal(ws[2].grad, upstream[2])
    assert torch.equal(ws[1].grad, torch.where(mask, upstream[1], 0))
