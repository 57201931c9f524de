"""MoE routing bookkeeping kernels (trace_kernels.moe_routing) against torch's sort, scatter and
index_add_: bit for bit, under TRITON_INTERPRET=1 on the CPU (CI) and on a GPU."""

import pytest
import torch

from tests.support.fp4 import triton_device
from trace_kernels.moe_routing import combine_experts, expert_order, route, scale_rows, scale_rows_backward


def _routing(n, k, e, seed):
    """Top-k expert ids [n, k], skewed so that some experts get many rows and some none."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g) + torch.linspace(0, 3, e)[None]
    return logits.topk(k, -1).indices


@pytest.mark.parametrize("n, h, e, k", [(64, 2048, 128, 8), (300, 256, 60, 4), (3, 200, 6, 2), (1, 64, 4, 4),
                                        (0, 128, 8, 2)])
def test_route_is_torchs_topk_softmax(n, h, e, k):
    """Same experts in the same order as torch.topk of the FP32 logits, gates within FP32
    rounding of torch's softmax (the kernel sums the same exact products in another order). The
    data keep every row's k-th and (k+1)-th logits apart, as real routers almost always do."""
    g = torch.Generator().manual_seed(n + h)
    x = (torch.randn(n, h, generator=g) * 2).bfloat16()
    w = (torch.randn(e, h, generator=g) / h**0.5).bfloat16().float()  # the engine holds BF16 values in FP32
    logits = x.float() @ w.T
    want_top, want_gate = route(x, w, k, backend="torch")
    assert torch.equal(want_top, logits.topk(k, -1).indices)
    assert torch.equal(want_gate, torch.softmax(logits.topk(k, -1).values, -1))
    ranked = logits.sort(-1, descending=True).values
    clear = (ranked[:, :k - 1] - ranked[:, 1:k]).min(1).values.clamp(max=1) if k > 1 else torch.ones(n)
    clear = torch.minimum(clear, ranked[:, k - 1] - ranked[:, k]) if k < e else clear
    dev = triton_device()
    top, gate = route(x.to(dev), w.to(dev), k, backend="triton")
    assert top.dtype == torch.int64 and gate.dtype == torch.float32 and top.shape == gate.shape == (n, k)
    ok = clear > 1e-4  # rows whose order FP32 rounding cannot change
    assert ok.float().mean() >= 0.95 or n < 4
    assert torch.equal(top.cpu()[ok], want_top[ok])
    torch.testing.assert_close(gate.cpu(), want_gate, atol=1e-6, rtol=0)  # equal gates either way round


def test_route_gives_a_nan_token_valid_experts():
    """A token whose hidden state holds NaN (a broken model) gets k distinct experts in range and
    NaN gates, as torch does (its order among NaN logits is unspecified): the expert ids index
    buffers downstream, so they must never leave 0..E-1. The other tokens are untouched."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 128, generator=g).bfloat16()
    x[1, 5] = float("nan")
    w = (torch.randn(16, 128, generator=g) * 0.1).bfloat16().float()
    top, gate = route(x.to(triton_device()), w.to(triton_device()), 4, backend="triton")
    top, gate = top.cpu(), gate.cpu()
    want_top, want_gate = route(x, w, 4, backend="torch")
    assert torch.isnan(gate[1]).all() and torch.isnan(want_gate[1]).all()
    assert len(set(top[1].tolist())) == 4 and int(top[1].min()) >= 0 and int(top[1].max()) < 16
    assert torch.equal(top[[0, 2]], want_top[[0, 2]])
    torch.testing.assert_close(gate[[0, 2]], want_gate[[0, 2]], atol=1e-6, rtol=0)


def test_route_refuses_what_does_not_fit():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        route(x, torch.zeros(4, 16), 2)
    with pytest.raises(ValueError, match="do not fit"):
        route(x, torch.zeros(4, 32), 5)


@pytest.mark.parametrize("n, k, e", [(64, 8, 128), (375, 8, 16), (5, 2, 4), (0, 2, 4), (1, 1, 3)])
def test_expert_order_is_torchs_stable_sort(n, k, e):
    """375 x 8 = 3000 rows: three loop steps of the kernel."""
    top = _routing(n, k, e, seed=n + e)
    want = expert_order(top, e, backend="torch")
    got = expert_order(top.to(triton_device()), e, backend="triton")
    for name, a, b in zip(("tok", "slot", "pos", "counts"), got, want, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a.cpu(), b), name
    tok, slot, pos, counts = want  # and the torch path is what it says
    flat = top.reshape(-1)
    assert torch.equal(counts, torch.bincount(flat, minlength=e))
    assert torch.equal(flat[tok * k + slot], flat.sort(stable=True).values)
    assert torch.equal(pos[tok * k + slot], torch.arange(n * k))


@pytest.mark.parametrize("n, k, h", [(64, 8, 2048), (7, 2, 96), (1, 1, 16), (0, 4, 32)])
def test_combine_experts_is_cpu_index_add(n, k, h):
    """index_add_ on the CPU adds each token's BF16 rows in order in FP32 and rounds once: the
    kernel's result must be those bits (its -0.0 included)."""
    g = torch.Generator().manual_seed(n + h)
    top = _routing(n, k, max(2 * k, 4), seed=h)
    tok, slot, pos, _ = expert_order(top, max(2 * k, 4), backend="torch")
    y = (torch.randn(n * k, h, generator=g) * torch.exp(2 * torch.randn(n * k, 1, generator=g))).bfloat16()
    gate = torch.softmax(torch.randn(n, k, generator=g), -1)
    want = torch.zeros(n, h, dtype=torch.bfloat16).index_add_(0, tok, (y * gate[tok, slot, None]).to(torch.bfloat16))
    dev = triton_device()
    got = combine_experts(y.to(dev), gate.to(dev), tok.to(dev), slot.to(dev), pos.to(dev), backend="triton").cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(combine_experts(y, gate, tok, slot, pos, backend="torch"), want)
    # with the residual stream added in the same kernel: as torch adds two BF16 tensors
    x = (torch.randn(n, h, generator=g) * 4).bfloat16()
    got = combine_experts(y.to(dev), gate.to(dev), tok.to(dev), slot.to(dev), pos.to(dev), residual=x.to(dev),
                          backend="triton").cpu()
    assert torch.equal(got.view(torch.int16), (x + want).view(torch.int16))


@pytest.mark.parametrize("rows, h", [(300, 64), (5, 2048), (3, 4100), (0, 32)])
def test_scale_rows_is_torchs_mixed_product_and_its_gradient(rows, h):
    """Forward and dy: the float32 product rounded once, bit for bit (the exact product, 8 x 24
    significand bits, fits float64); dgate: float64's sum of grad * y within float32 summation
    error (torch's own order differs from the kernel's). h = 4100 takes the backward's loop over
    column blocks with a ragged last one."""
    g = torch.Generator().manual_seed(rows + h)
    y = (torch.randn(rows, h, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))).bfloat16()
    gate = torch.rand(rows, generator=g)
    grad = torch.randn(rows, h, generator=g).bfloat16()
    dev = triton_device()
    exact = (y.double() * gate.double()[:, None]).float().bfloat16()
    got = scale_rows(y.to(dev), gate.to(dev), backend="triton").cpu()
    assert torch.equal(got.view(torch.int16), exact.view(torch.int16))
    assert torch.equal(scale_rows(y, gate, backend="torch").view(torch.int16), exact.view(torch.int16))
    dy, dgate = scale_rows_backward(grad.to(dev), y.to(dev), gate.to(dev), backend="triton")
    assert torch.equal(dy.cpu().view(torch.int16), (grad.double() * gate.double()[:, None]).float().bfloat16()
                       .view(torch.int16))
    want = (grad.double() * y.double()).sum(-1)
    bound = 2 * h * torch.finfo(torch.float32).eps * (grad.double() * y.double()).abs().sum(-1) + 1e-30
    assert dgate.dtype == torch.float32 and ((dgate.cpu().double() - want).abs() <= bound).all()
    with pytest.raises(ValueError, match=r"gate float32 \[R\]"):
        scale_rows(y, gate.double())


def test_combine_experts_refuses_a_residual_that_does_not_fit():
    top = _routing(3, 2, 4, seed=0)
    tok, slot, pos, _ = expert_order(top, 4, backend="torch")
    with pytest.raises(ValueError, match=r"residual must be bfloat16 \[3, 8\]"):
        combine_experts(torch.zeros(6, 8).bfloat16(), torch.ones(3, 2), tok, slot, pos, residual=torch.zeros(3, 8))


def test_combine_experts_refuses_rows_that_do_not_fit():
    with pytest.raises(ValueError, match=r"bfloat16 \[6, H\]"):
        combine_experts(torch.zeros(5, 8).bfloat16(), torch.ones(3, 2), *(torch.zeros(6, dtype=torch.long),) * 3)


@pytest.mark.parametrize("family, n_group, topk_group, k, scaling, normalize", [
    ("deepseek_v3", 8, 4, 8, 2.5, True),  # DeepSeek-V3's own numbers, 64 experts instead of 256
    ("deepseek_v3", 4, 1, 3, 1.0, False),
    ("glm4_moe", 1, 1, 8, 1.0, True),  # GLM-4.5: no groups
])
def test_sigmoid_grouped_router_is_transformers(family, n_group, topk_group, k, scaling, normalize):
    """top_k_sigmoid_grouped on the router's FP32 logits chooses the experts that transformers'
    DeepseekV3TopkRouter / Glm4MoeTopkRouter choose, with an expert bias large enough to change the
    choice, and their gates to FP32 rounding (the normalising sum adds the k scores in another order)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from trace_kernels.moe_routing import top_k_sigmoid_grouped

    e, hidden, n = 64, 96, 200
    config_cls, router_cls = {"deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter),
                              "glm4_moe": (Glm4MoeConfig, Glm4MoeTopkRouter)}[family]
    config = config_cls(hidden_size=hidden, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                        topk_group=topk_group, routed_scaling_factor=scaling, norm_topk_prob=normalize)
    router = router_cls(config)
    g = torch.Generator().manual_seed(k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, hidden, generator=g) / hidden**0.5)
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.1)
    h = torch.randn(n, hidden, generator=g).bfloat16()
    with torch.no_grad():
        logits, want_gate, want_top = router(h)
    top, gate = top_k_sigmoid_grouped(logits, k, router.e_score_correction_bias, n_group=n_group,
                                      topk_group=topk_group, scaling=scaling, normalize=normalize)
    order, want_order = top.argsort(-1), want_top.argsort(-1)  # transformers' top k is unsorted
    assert torch.equal(top.gather(1, order), want_top.gather(1, want_order))
    torch.testing.assert_close(gate.gather(1, order), want_gate.gather(1, want_order), rtol=1e-6, atol=0)
    unbiased = top_k_sigmoid_grouped(logits, k, torch.zeros(e), n_group=n_group, topk_group=topk_group)[0]
    assert not torch.equal(unbiased.sort(-1).values, top.sort(-1).values)  # the bias did pick
    by_score = (logits.sigmoid() + router.e_score_correction_bias).gather(1, top)
    assert (by_score[:, :-1] >= by_score[:, 1:]).all()  # descending biased score
    with pytest.raises(ValueError, match="do not fit"):
        top_k_sigmoid_grouped(logits, k, torch.zeros(e + 1), n_group=n_group, topk_group=topk_group)
