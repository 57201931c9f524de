"""Guidance test helpers: engine/trainer activations with realistic drift, and records of them."""

import torch

from megatron_trace.guidance import DEFAULT_TAU, Coding, capture
from trace_kernels.fp4 import quantize

META = dict(model_id="tiny-moe", policy="all")


def matmul_two_orders(rows, k_in, cols, seed):
    """Engine and trainer activations: one BF16 matmul, reduced in two different orders."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, k_in, generator=g) * torch.exp(0.8 * torch.randn(1, k_in, generator=g))).bfloat16()
    w = (torch.randn(k_in, cols, generator=g) / k_in**0.5).bfloat16()
    engine = (a.float() @ w.float()).bfloat16()
    h = k_in // 3
    trainer = ((a[:, :h].float() @ w[:h].float()).bfloat16().float() + (a[:, h:].float() @ w[h:].float())).bfloat16()
    return engine, trainer


def record_for(x, coding=Coding.DENSE, sample_id="s0", layer=3, site="fc1", version=7, tau=DEFAULT_TAU,
               scale_coding="lsb"):
    q = quantize(x, scale="row")
    kw = {} if coding == Coding.DENSE else {"tau": tau, "scale_coding": scale_coding}
    rec = capture(x, q, layer=layer, site=site, sample_id=sample_id, weight_version=version, coding=coding, **kw,
                  **META)
    return rec, q


CODINGS = [(Coding.DENSE, None), (Coding.SPARSE, "lsb"), (Coding.SPARSE, "near")]
