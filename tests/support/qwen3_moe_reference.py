"""An independent plain-torch forward of the Qwen3-MoE model, written from the architecture.

It reads the full (one-process Megatron) state dict and plays two roles in the tests: the
reference the Megatron model's math is checked against, and a stand-in rollout engine that
computes in another precision (float32 activations), quantizes each FP4 site with the shared
quantizer and returns each site's pre-quantization rows in the canonical order of
`MicroBatchGuidance` (tokens; (token, KV head) for k/v; (token, slot) for fc2).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from trace_kernels.fp4 import fake_quantize


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _rope(x, pos, base):  # x [T, heads, d], non-interleaved halves (Megatron's and HF's default)
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def forward(sd: dict, cfg, seqs: list[torch.Tensor], *, fp4: bool, dtype=torch.float32, replay=None):
    """Packed forward of token sequences.

    Args:
        sd: full state dict. cfg: ModelConfig. seqs: int64 token tensors, packed in order.
        fp4: quantize the FP4 sites (weights per tensor, rows per row, round to nearest).
        dtype: activation/weight dtype of the computation.
        replay: layer -> int64 [T, top_k] expert ids to use instead of the router's choice.
    Returns:
        (logits float32 [T, V], site rows {(layer, site): [R, K]}, routed experts {layer: [T, top_k]})
    """
    w = {k: v.to(dtype) for k, v in sd.items()}
    fq = (lambda t: fake_quantize(t, scale="row")) if fp4 else (lambda t: t)
    fqw = (lambda t: fake_quantize(t, scale="tensor")) if fp4 else (lambda t: t)
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    bounds = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).tolist()
    nq, ng, d, k = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.top_k
    rows, routed = {}, {}
    x = w["embedding.word_embeddings.weight"][ids]
    T = x.shape[0]
    for L in range(cfg.num_layers):
        p = f"decoder.layers.{L}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        rows[(L, "qkv")] = h
        qkv = (fq(h) @ fqw(w[p + "self_attention.linear_qkv.weight"]).T).view(T, ng, nq // ng + 2, d)
        q = qkv[:, :, : nq // ng].reshape(T, nq, d)
        kk, v = qkv[:, :, -2], qkv[:, :, -1]
        q = _rope(_rms(q, w[p + "self_attention.q_layernorm.weight"], cfg.rms_norm_eps), pos, cfg.rope_theta)
        kk = _rope(_rms(kk, w[p + "self_attention.k_layernorm.weight"], cfg.rms_norm_eps), pos, cfg.rope_theta)
        rows[(L, "k")], rows[(L, "v")] = kk.reshape(-1, d), v.reshape(-1, d)
        kk, v = fq(kk), fq(v)
        ctx = torch.empty(T, nq, d, dtype=dtype)
        for lo, hi in pairwise(bounds):
            qs, ks, vs = (t[lo:hi].transpose(0, 1) for t in (q, kk, v))
            ks, vs = ks.repeat_interleave(nq // ng, 0), vs.repeat_interleave(nq // ng, 0)
            ctx[lo:hi] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        ctx = ctx.reshape(T, nq * d)
        rows[(L, "proj")] = ctx
        x = x + fq(ctx) @ fqw(w[p + "self_attention.linear_proj.weight"]).T
        h = _rms(x, w[p + "pre_mlp_layernorm.weight"], cfg.rms_norm_eps)
        rows[(L, "fc1")] = h
        logits_r = h.float() @ sd[p + "mlp.router.weight"].float().T
        top = torch.topk(logits_r, k, dim=-1).indices if replay is None else replay[L]
        routed[L] = top
        gate = torch.softmax(logits_r.gather(1, top), -1)
        hq = fq(h)
        fc2_rows = torch.empty(T, k, cfg.moe_intermediate_size, dtype=dtype)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(cfg.num_experts):
            tok, slot = (top == e).nonzero(as_tuple=True)
            if len(tok) == 0:
                continue
            e_p = p + f"mlp.experts.local_experts.{e}."
            g_u = hq[tok] @ fqw(w[e_p + "linear_fc1.weight"]).T
            gt, up = g_u.chunk(2, -1)
            act = F.silu(gt) * up
            fc2_rows[tok, slot] = act
            y = fq(act) @ fqw(w[e_p + "linear_fc2.weight"]).T
            out.index_add_(0, tok, y.float() * gate[tok, slot, None])
        rows[(L, "fc2")] = fc2_rows.reshape(T * k, -1)
        x = x + out.to(dtype)
    x = _rms(x, w["decoder.final_layernorm.weight"], cfg.rms_norm_eps)
    return (x @ w["output_layer.weight"].T).float(), rows, routed
