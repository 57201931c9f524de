"""The trainer's core attention on THD-packed sequences against a float64 causal attention
computed per sequence by hand: lengths repeated, unique, of one token and across the length
classes that are padded together, padding at the end, GQA; values and the gradients of q, k and v."""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from megatron_trace.megatron.attention import FP4CoreAttention
from megatron_trace.packed_attention import _varlen_fits

LENGTHS = [5, 5, 3, 5, 1, 3, 7, 9, 16, 2]  # length classes 1, 2, 4, 8, 16, padded within
PAD = 2
HEADS, KV_HEADS, D = 4, 2, 8


def _attention():
    module = FP4CoreAttention.__new__(FP4CoreAttention)  # only the packed path's state: the softmax scale
    torch.nn.Module.__init__(module)
    module.softmax_scale = 1 / math.sqrt(D)
    module.rope = None
    return module


def _reference(q, k, v, cu):
    """float64 softmax(q k^T / sqrt(d) + causal mask) v per sequence; padding rows zero."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for lo, hi in zip(cu[:-1], cu[1:], strict=True):
        qs, ks, vs = (t[lo:hi].double().transpose(0, 1) for t in (q, k, v))  # [heads, L, d]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(hi - lo, hi - lo, dtype=torch.bool).triu(1), -math.inf)
        out[lo:hi] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out.reshape(q.shape[0], -1)


def _bf16_sdpa(q, k, v, cu, upstream):
    """An independent BF16 computation of the same attention: torch's SDPA per sequence on the
    same device (causal, grouped K/V heads); its output [T, heads * d] and q/k/v gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1] * D, dtype=q.dtype, device=q.device)
    for lo, hi in zip(cu[:-1], cu[1:], strict=True):
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, L, d]
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1).reshape(hi - lo, -1)
    out.backward(upstream)
    return out.detach(), (q.grad, k.grad, v.grad)


CASES = [("cpu", torch.float32)]
if torch.cuda.is_available():  # flash attention (torch's varlen kernel where it has one): BF16
    CASES.append(("cuda", torch.bfloat16))


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_packed_attention_is_per_sequence_causal_attention(device, dtype):
    """Against float64: within 1e-5 in float32; in BF16 (flash kernels) within twice the error of
    torch's own BF16 SDPA on the same device, three times for the gradients (the bound
    flash-attention's tests use: BF16 rounding differs by kernel, not by a fixed tolerance)."""
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    tokens = cu[-1] + PAD
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, D, generator=g).to(device, dtype).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    if device == "cuda":
        print("varlen flash attention:", _varlen_fits(q, k, v))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                          cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=max(LENGTHS),
                          max_seqlen_kv=max(LENGTHS))
    out = _attention()(q, k, v, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    assert out.shape == (tokens, HEADS * D) and out.dtype == dtype
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    want = _reference(q64, k64, v64, cu)
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream.to(device, dtype))
    want.backward(upstream.double())
    assert not out[-PAD:].any()
    assert not q.grad[-PAD:].any()  # padding takes no gradient
    pairs = [(out, want)] + [(t.grad, t64.grad) for t, t64 in ((q, q64), (k, k64), (v, v64))]
    if dtype == torch.float32:
        for got, ref in pairs:
            torch.testing.assert_close(got.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-6)
        return
    base_out, base_grads = _bf16_sdpa(q, k, v, cu, upstream.to(device, dtype))
    for (got, ref), base, factor, what in zip(pairs, (base_out, *base_grads), (2, 3, 3, 3),
                                               ("out", "dq", "dk", "dv"), strict=True):
        ref = ref.detach()
        ours = (got[:cu[-1]].cpu().double() - ref[:cu[-1]]).abs().max().item()
        torch_bf16 = (base[:cu[-1]].cpu().double() - ref[:cu[-1]]).abs().max().item()
        assert ours <= factor * torch_bf16 + 1e-5, f"{what}: error {ours:.2e}, torch's BF16 SDPA {torch_bf16:.2e}"


def _rotate_in_megatron(rank):
    """In a process with Megatron's parallel state: a model's core attention rotating a pack."""
    from megatron_trace.megatron.model import build_model
    from megatron_trace.model_config import PRESETS

    cfg = PRESETS["tiny"]
    core = build_model(cfg, "bf16").decoder.layers[0].self_attention.core_attention
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(cu[-1] + PAD, cfg.num_attention_heads, cfg.head_dim, generator=g)
    k = torch.randn(cu[-1] + PAD, cfg.num_key_value_heads, cfg.head_dim, generator=g)
    device = core.rope(1).device  # the model's (a GPU where there is one)
    got_q, got_k = (t.cpu() for t in core._rotate(q.to(device), k.to(device), cu))
    return dict(q=q, k=k, got_q=got_q, got_k=got_k, theta=cfg.rope_theta)


def test_rope_over_the_pack_is_each_tokens_rotation_at_its_position_in_its_sequence():
    from megatron_trace.megatron.spawn import spawn

    (r,) = spawn(_rotate_in_megatron, {})
    d = r["q"].shape[-1]
    inv = r["theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    pos = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.zeros(PAD, dtype=torch.long)]).double()
    angle = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]  # [T, 1, d]: the halves rotate together
    for x, got in ((r["q"], r["got_q"]), (r["k"], r["got_k"])):
        x = x.double()
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        torch.testing.assert_close(got.double(), x * angle.cos() + rotated * angle.sin(), rtol=1e-5, atol=1e-5)


def test_cu_seqlens_reach_the_host_once_a_forward_and_must_agree():
    """Every attention layer of a forward reads the same PackedSeqParams: its cu_seqlens are copied
    to the host once (on a GPU each copy waits for the queue), and K's must equal Q's."""
    from megatron_trace.megatron.attention import host_cu_seqlens

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=5, max_seqlen_kv=5)
    first = host_cu_seqlens(psp)
    assert first == [0, 3, 8] and host_cu_seqlens(psp) is first
    psp.cu_seqlens_q = torch.tensor([0, 2, 8], dtype=torch.int32)  # a new tensor is read anew, and checked
    with pytest.raises(NotImplementedError, match="cu_seqlens_kv == cu_seqlens_q"):
        host_cu_seqlens(psp)


@pytest.mark.parametrize("shape", [(37, 2, 8, 128), (50, 4, 64), (3, 1, 2, 96)])  # [S, B, h, d] and THD [T, h, d]
def test_rotate_pair_is_megatrons_rope_bit_for_bit(shape):
    """The fused rotary embedding (the CPU interpreter here; a GPU's path) against Megatron's own
    unfused rotary embedding (`_apply_rotary_pos_emb_bshd`, what `apply_rotary_pos_emb` runs without
    context parallelism or TE's fusion): the same query and key bits, and the same gradients, since
    the keys it rotates are what the FP4 KV-cache site quantizes as the engine does."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_trace.megatron.attention import rotate_pair

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    g = torch.Generator().manual_seed(shape[-1])
    n, d = shape[0], shape[-1]
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel on a GPU, else the interpreter
    q, k = ((torch.randn(*shape, generator=g) * 3).bfloat16().to(dev) for _ in range(2))
    freqs = (torch.rand(n, 1, 1, d, generator=g) * 50).to(dev)  # far-turned angles: cos and sin of every sign
    up_q, up_k = (torch.randn(*shape, generator=g).bfloat16().to(dev) for _ in range(2))

    def run(fn):
        a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
        ra, rb = fn(a, b)
        torch.autograd.backward((ra, rb), (up_q, up_k))
        return ra.detach(), rb.detach(), a.grad, b.grad

    def megatron(a, b):
        if a.dim() == 3:  # THD: a batch dim of one, as FP4CoreAttention calls it
            return tuple(_apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs).squeeze(1) for t in (a, b))
        return _apply_rotary_pos_emb_bshd(a, freqs), _apply_rotary_pos_emb_bshd(b, freqs)

    got = run(lambda a, b: rotate_pair(a, b, freqs, config, backend="triton"))
    for x, y in zip(got, run(megatron), strict=True):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y)
