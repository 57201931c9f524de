"""The two kernels a decode step spends its bytes in, FP4 against BF16 and against the bandwidth floor.

- MoE grouped GEMM (fc1 and fc2 of one layer): batch * top_k rows routed uniformly over the
  experts; FP4 is `fp4_grouped_linear` (codes dequantized in registers), BF16 is
  torch._grouped_mm (cuBLAS). The floor reads the weights of the experts that get rows.
- Attention projections (qkv, proj): `fp4_linear` against a cuBLAS BF16 matmul, batch rows.
- Paged decode attention over `context` cached tokens per sequence: our split-K kernel on the
  FP4 cache and on a BF16 cache. The floor reads the cache.

    python bench/decode_kernels.py --model qwen3-30b-a3b --batch 64 --context 8192 [--sweep] [--record]

Needs a CUDA GPU. --sweep times the kernels' launch shapes (TILE in linear.py / paged_attention.py).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
from rollout_throughput import replay_seconds  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
COPY_BANDWIDTH = 4.25e12  # H200 device copy measured in bench/results/fp4_quantize_*_h200.md


def gpu_ms(fn, reps: int = 20, per_graph: int = 10) -> float:
    """Median milliseconds of one fn() on the GPU: `per_graph` calls captured in a CUDA graph and
    replayed `reps` times, timed with CUDA events. Replaying takes the host out: timing eager
    calls would measure Python and Triton's launcher (tens of microseconds per launch), not the
    kernels."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm the allocator outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    return statistics.median(replay_seconds(graph, reps)) * 1e3 / per_graph


def gemm_cases(cfg, batch: int, gen):
    """(name, fp4 fn, bf16 fn, fp4 bytes, bf16 bytes) for fc1 and fc2 of one MoE layer."""
    from trace_kernels.fp4 import quantize
    from trace_kernels.fp4.linear import fp4_grouped_linear

    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    top = torch.rand(batch, e, generator=gen, device="cuda").topk(cfg.top_k, -1).indices.reshape(-1)
    counts = torch.bincount(top, minlength=e)
    touched = int((counts > 0).sum())
    cases = []
    for name, (n, k) in (("fc1", (2 * inter, h)), ("fc2", (h, inter))):
        w = torch.randn(e, n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q = [quantize(w[i]) for i in range(e)]
        codes = torch.stack([t.codes for t in q])
        scales = torch.stack([t.block_scales for t in q])
        g = torch.stack([t.global_scale for t in q])
        x = torch.randn(batch * cfg.top_k, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        offs = counts.cumsum(0).to(torch.int32)
        wt = w.transpose(1, 2)
        act = 2 * x.numel() + 2 * x.shape[0] * n
        cases.append((name, lambda backend="auto", x=x, c=codes, s=scales, g=g: fp4_grouped_linear(x, c, s, g, counts,
                                                                                                  backend=backend),
                      lambda x=x, wt=wt, o=offs: torch._grouped_mm(x, wt, offs=o),
                      touched * n * k * 0.5625 + act, touched * n * k * 2 + act))
    return cases


def dense_cases(cfg, batch: int, gen):
    """(name, fp4 fn, bf16 fn, fp4 bytes, bf16 bytes) for the attention projections (qkv, proj)."""
    from trace_kernels.fp4 import quantize
    from trace_kernels.fp4.linear import fp4_linear

    h, d = cfg.hidden_size, cfg.head_dim
    cases = []
    for name, (n, k) in (("qkv", ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h)),
                         ("proj", (h, cfg.num_attention_heads * d))):
        w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q = quantize(w)
        x = torch.randn(batch, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        act = 2 * batch * (k + n)
        cases.append((name, lambda backend="auto", x=x, q=q: fp4_linear(x, q, backend=backend),
                      lambda x=x, w=w: x @ w.T, n * k * 0.5625 + act, n * k * 2 + act))
    return cases


def attention_case(cfg, batch: int, context: int, gen):
    """(fp4 fn(backend), bf16 fn, fp4 bytes, bf16 bytes) of one layer's decode attention."""
    from trace_kernels.fp4 import quantize
    from trace_kernels.fp4.paged_attention import paged_decode_attention

    hq, hkv, d, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16
    blocks = batch * context // bs
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))  # blocks scattered over the pool
    tables = perm.to("cuda", torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    fp4, bf16 = [], []
    for _ in range(2):  # K and V
        rows = torch.randn(blocks * bs, hkv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        t = quantize(rows, scale="row")
        fp4.append({"codes": t.codes, "scales": t.block_scales.view(torch.uint8), "g": t.global_scale})
        bf16.append({"rows": rows})
    kv = 2 * batch * context * hkv
    return (lambda backend="auto", **split: paged_decode_attention(q, fp4[0], fp4[1], tables, lens, bs,
                                                                   backend=backend, **split),
            lambda: paged_decode_attention(q, bf16[0], bf16[1], tables, lens, bs),
            kv * (d * 0.5625 + 4), kv * d * 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--bandwidth", type=float, default=COPY_BANDWIDTH)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="",
                    help="comma-separated kernels to time (fc1,fc2,qkv,proj,attention); all by default")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels.py needs a CUDA GPU")
    from megatron_trace.model_config import PRESETS
    from trace_kernels.fp4 import cuda_decode, linear, paged_attention

    cfg = PRESETS[args.model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def measure(kernel, fp4_fn, bf16_fn, fp4_bytes, bf16_bytes, tile):
        if args.only and kernel not in args.only.split(","):
            return
        fp4_ms, bf16_ms = gpu_ms(fp4_fn), gpu_ms(bf16_fn)
        floor_fp4, floor_bf16 = fp4_bytes / args.bandwidth * 1e3, bf16_bytes / args.bandwidth * 1e3
        row = {"kernel": kernel, "tile": dict(tile), "fp4_ms": fp4_ms, "bf16_ms": bf16_ms,
               "fp4_floor_ms": floor_fp4, "bf16_floor_ms": floor_bf16}
        rows.append(row)
        print(f"{kernel:9s} {str(tile):40s} fp4 {fp4_ms:7.3f} ms ({fp4_ms / floor_fp4:5.2f}x floor)  "
              f"bf16 {bf16_ms:7.3f} ms ({bf16_ms / floor_bf16:5.2f}x floor)  bf16/fp4 {bf16_ms / fp4_ms:5.2f}",
              flush=True)

    gemm_tiles = [dict(block_n=bn, block_k=bk, num_warps=nw, programs=p)
                  for bn, bk, nw, p in itertools.product((64, 128), (128, 256), (4, 8), (4, 16))] \
        if args.sweep else [dict(linear.TILE)]
    attn_tiles = [dict(block_t=bt, num_warps=nw) for bt, nw in itertools.product((32, 64), (4, 8))] \
        if args.sweep else [dict(paged_attention.TILE)]
    default_gemm, default_attn = dict(linear.TILE), dict(paged_attention.TILE)
    for name, fp4_fn, bf16_fn, fp4_bytes, bf16_bytes in (gemm_cases(cfg, args.batch, gen)
                                                          + dense_cases(cfg, args.batch, gen)):
        if cuda_decode.supports_gemm(torch.empty(1, device="cuda"), 128, 128):
            dense = name in ("qkv", "proj")  # dense_linear: K split until this many programs a multiprocessor
            blocks_key = "dense_min_blocks" if dense else "gemm_min_blocks"
            per_sm_sweep = (1, 2, 3, 4, 8) if args.sweep and dense else [linear.DENSE_PROGRAMS_PER_SM]
            for mb, per_sm in itertools.product((1, 2, 3, 4) if args.sweep else [cuda_decode.LAUNCH[blocks_key]],
                                                per_sm_sweep):
                default_launch, default_per_sm = dict(cuda_decode.LAUNCH), linear.DENSE_PROGRAMS_PER_SM
                cuda_decode.LAUNCH[blocks_key], linear.DENSE_PROGRAMS_PER_SM = mb, per_sm
                measure(name, lambda f=fp4_fn: f("cuda"), bf16_fn, fp4_bytes, bf16_bytes,
                        {"kernel": "cuda_decode", "min_blocks": mb} | ({"programs_per_sm": per_sm} if dense else {}))
                cuda_decode.LAUNCH.update(default_launch)
                linear.DENSE_PROGRAMS_PER_SM = default_per_sm
        for tile in gemm_tiles:  # the Triton kernels: the FP4 path where the CUDA kernel does not apply
            linear.TILE.update(tile)
            measure(name, lambda f=fp4_fn: f("triton"), bf16_fn, fp4_bytes, bf16_bytes, tile)
    linear.TILE.update(default_gemm)
    fp4_attn, *attn = attention_case(cfg, args.batch, args.context, gen)
    if cuda_decode.supports_attention(torch.empty(1, cfg.num_attention_heads, cfg.head_dim, device="cuda"),
                            {"codes": torch.empty(1, cfg.num_key_value_heads, 1)}, 16):
        default_launch = dict(cuda_decode.LAUNCH)
        split = {"min_chunk": paged_attention.MIN_CHUNK,  # the default split of the CUDA kernel for this batch
                 "max_splits": cuda_decode.attention_splits(args.batch, cfg.num_key_value_heads, torch.device("cuda"),
                                                            paged_attention.MAX_SPLITS)}
        for mb, mc, ms in itertools.product((8, 12, 16), (256, 512), (16, 32)) if args.sweep else [
                (default_launch["attention_min_blocks"], split["min_chunk"], split["max_splits"])]:
            cuda_decode.LAUNCH["attention_min_blocks"] = mb
            measure("attention", lambda mc=mc, ms=ms: fp4_attn("cuda", min_chunk=mc, max_splits=ms), *attn,
                    {"kernel": "cuda_decode", "min_blocks": mb, "min_chunk": mc, "max_splits": ms})
        cuda_decode.LAUNCH.update(default_launch)
    for tile in attn_tiles:  # the Triton split kernel: the FP4 path where the CUDA kernel does not apply
        paged_attention.TILE.update(tile)
        measure("attention", lambda: fp4_attn("triton"), *attn, tile)
    paged_attention.TILE.update(default_attn)

    if args.record:
        date, gpu = datetime.date.today().isoformat(), torch.cuda.get_device_name()
        stem = RESULTS / f"decode_kernels_{date}_{gpu.split()[-1].lower()}"
        meta = {"date": date, "gpu": gpu, "model": args.model, "batch": args.batch, "context": args.context,
                "command": "python bench/decode_kernels.py " + " ".join(sys.argv[1:])}
        stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        lines = [f"# Decode kernels, {date}, {gpu}", "", f"`{meta['command']}`", "",
                 f"{args.model} shapes, batch {args.batch}, context {args.context}; floor at "
                 f"{args.bandwidth / 1e12:.2f} TB/s.", "",
                 "| kernel | launch | FP4 ms | FP4 / floor | BF16 ms | BF16 / floor | BF16 / FP4 |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['kernel']} | {r['tile']} | {r['fp4_ms']:.3f} | {r['fp4_ms'] / r['fp4_floor_ms']:.2f} | "
                         f"{r['bf16_ms']:.3f} | {r['bf16_ms'] / r['bf16_floor_ms']:.2f} | "
                         f"{r['bf16_ms'] / r['fp4_ms']:.2f} |")
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
