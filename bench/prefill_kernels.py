"""Prefill-sized FP4 GEMMs and prefill attention: the engine's paths against BF16, one GPU.

Hopper has no FP4 MMA. At decode sizes the FP4 kernels win on bytes (4.5 bits per weight);
at prefill sizes the work is FLOPs, and a kernel that dequantizes each weight tile once per 64
rows (the Triton FP4 GEMMs) pays for that per tile. This times, at Qwen3-30B-A3B's shapes:
- dense GEMMs (qkv, proj): BF16 cuBLAS; the Triton FP4 kernel; the weight dequantized once then
  cuBLAS (`fp4_linear` at or above `DEQUANT_GEMM_ROWS` rows);
- the experts' grouped GEMMs (fc1, fc2; tokens routed uniformly to top-8 of 128): BF16
  `torch._grouped_mm`; the Triton FP4 grouped kernel; all experts dequantized in one launch then
  the grouped GEMM (`fp4_grouped_linear` at or above `DEQUANT_EXPERT_ROWS` rows per expert);
- prefill attention of one sequence's chunk over its cache (32 query / 4 KV heads of 128):
  SDPA with an explicit boolean mask (GQA then runs SDPA's math kernel) against
  `cached_causal_attention` (torch's lower-right causal bias: flash attention).
Each row states which path `auto` takes at that size, and the FP4/BF16 time ratio.

    python bench/prefill_kernels.py --record     # bench/results/prefill_kernels_<date>_<gpu>.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
from fp4_quantize import RESULTS, time_fn  # bench/ is on sys.path

from trace_kernels.fp4 import dequantize, quantize
from trace_kernels.fp4 import linear as L
from trace_kernels.fp4.paged_attention import cached_causal_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, EXPERT_FFN = 2048, 32, 4, 128, 128, 8, 768
DENSE = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "proj": (HIDDEN, HEADS * HEAD_DIM)}
GROUPED = {"fc1": (2 * EXPERT_FFN, HIDDEN), "fc2": (HIDDEN, EXPERT_FFN)}


def dense_rows(tokens: list[int], device: str) -> list[dict]:
    rows = []
    for name, (n, k) in DENSE.items():
        w_bf16 = torch.randn(n, k, device=device).bfloat16()
        w = quantize(w_bf16.float())
        for m in tokens:
            x = torch.randn(m, k, device=device).bfloat16()
            t_bf16 = time_fn(lambda x=x, w_bf16=w_bf16: x @ w_bf16.T, device)
            t_triton = time_fn(lambda x=x, w=w: L.sum_parts(L._fp4_linear_triton(x, w)), device)
            t_deq = time_fn(lambda x=x, w=w: x @ dequantize(w, torch.bfloat16).T, device)
            auto = ("dequant+cuBLAS" if m >= L.DEQUANT_GEMM_ROWS
                    else "cuda" if m <= L.DENSE_CUDA_ROWS else "triton")
            rows.append({"gemm": name, "tokens": m, "bf16_us": t_bf16 * 1e6, "fp4_triton_us": t_triton * 1e6,
                         "fp4_dequant_us": t_deq * 1e6, "auto": auto,
                         "tflops_bf16": 2 * m * n * k / t_bf16 / 1e12})
    return rows


def grouped_rows(tokens: list[int], device: str) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, (n, k) in GROUPED.items():
        w_bf16 = torch.randn(EXPERTS, n, k, device=device).bfloat16()
        qs = [quantize(w_bf16[e].float()) for e in range(EXPERTS)]
        codes, scales = torch.stack([q.codes for q in qs]), torch.stack([q.block_scales for q in qs])
        gs = torch.stack([q.global_scale for q in qs])
        del qs
        for t in tokens:
            picks = torch.rand(t, EXPERTS, generator=gen).topk(TOP_K, -1).indices.flatten()
            counts = torch.bincount(picks, minlength=EXPERTS).to(device)
            m = int(counts.sum())
            x = torch.randn(m, k, device=device).bfloat16()
            offs = counts.cumsum(0).to(torch.int32)
            fp4 = (codes, scales, gs, counts)
            t_bf16 = time_fn(lambda x=x, w=w_bf16, o=offs: torch._grouped_mm(x, w.transpose(1, 2), offs=o), device)
            t_triton = time_fn(lambda x=x, a=fp4: L.fp4_grouped_linear(x, *a, backend="triton"), device)
            t_deq = time_fn(lambda x=x, a=fp4: L._dequantized_grouped_mm(x, *a), device)
            auto = "dequant+grouped_mm" if m >= L.DEQUANT_EXPERT_ROWS * EXPERTS else (
                "cuda" if m <= L.cuda_decode.GEMM_ROWS * EXPERTS else "triton")
            rows.append({"gemm": name, "tokens": t, "rows": m, "bf16_us": t_bf16 * 1e6,
                         "fp4_triton_us": t_triton * 1e6, "fp4_dequant_us": t_deq * 1e6, "auto": auto,
                         "tflops_bf16": 2 * m * n * k / t_bf16 / 1e12})
        del w_bf16, codes, scales
    return rows


def attention_rows(cases: list[tuple[int, int]], device: str) -> list[dict]:
    rows = []
    for start, m in cases:
        q = torch.randn(m, HEADS, HEAD_DIM, device=device).bfloat16()
        k, v = (torch.randn(start + m, KV_HEADS, HEAD_DIM, device=device).bfloat16() for _ in range(2))
        mask = torch.arange(start + m, device=device)[None] <= (start + torch.arange(m, device=device))[:, None]

        def explicit(q=q, k=k, v=v, mask=mask):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True)

        def bias(q=q, k=k, v=v, start=start):
            return cached_causal_attention(q, k, v, start)

        t_mask, t_bias = time_fn(explicit, device), time_fn(bias, device)
        diff = (explicit().transpose(0, 1).float() - bias().float()).abs().max()
        rows.append({"start": start, "new": m, "explicit_mask_us": t_mask * 1e6, "lower_right_us": t_bias * 1e6,
                     "speedup": t_mask / t_bias, "max_abs_diff": float(diff)})
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = (lambda v: f"{v:.1f}" if isinstance(v, float) and abs(v) >= 1 else f"{v:.3g}" if isinstance(v, float)
           else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) for c in keys) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="256,1024,4096,16384", help="token counts of the GEMMs")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_kernels.py times GPU kernels; the CPU tests check their values")
    device, name = "cuda", torch.cuda.get_device_name()
    tokens = [int(t) for t in args.tokens.split(",")]
    for rows in (dense := dense_rows(tokens, device), grouped := grouped_rows(tokens, device)):
        for r in rows:
            r["fp4_over_bf16_triton"] = r["fp4_triton_us"] / r["bf16_us"]
            r["fp4_over_bf16_dequant"] = r["fp4_dequant_us"] / r["bf16_us"]
    attn = attention_rows([(0, 2048), (2048, 2048), (6144, 2048), (0, 8192)], device)
    date = datetime.date.today().isoformat()
    command = "python bench/prefill_kernels.py --record" + (f" --tokens {args.tokens}" if args.tokens else "")
    text = (f"# Prefill-sized FP4 GEMMs and prefill attention\n\n{date}, {name}, torch {torch.__version__}. "
            f"Qwen3-30B-A3B shapes; median of triton.testing.do_bench. `auto`: the path `fp4_linear` / "
            f"`fp4_grouped_linear` take at that size (DEQUANT_GEMM_ROWS={L.DEQUANT_GEMM_ROWS}, "
            f"DEQUANT_EXPERT_ROWS={L.DEQUANT_EXPERT_ROWS}).\n\nCommand: `{command}`\n\n"
            f"## Dense\n\n{table(dense)}\n\n## Experts (grouped)\n\n{table(grouped)}\n\n"
            f"## Prefill attention (one sequence)\n\n{table(attn)}\n")
    print(text)
    if args.record:
        tag = f"prefill_kernels_{date}_{'h200' if 'H200' in name else 'gpu'}"
        (RESULTS / f"{tag}.md").write_text(text)
        (RESULTS / f"{tag}.json").write_text(json.dumps({"date": date, "device": name, "command": command,
                                                          "dense": dense, "grouped": grouped, "attention": attn},
                                                         indent=1))
        print(f"wrote {RESULTS / tag}.md/.json")


if __name__ == "__main__":
    main()
