"""Training step time of a Qwen3-MoE-shaped Megatron model per trainer precision: bf16, fp4-rne (QAT)
and fp4-guided (QAT following guidance; the trace run mode's trainer).

One process, one device. The model has the preset's full width and `--layers` layers; a step
is forward + backward of one packed micro-batch of `--tokens` tokens (sequences of
`--seq-len`) and an AdamW step. `trace` runs with dense guidance at every site of every layer
and rollout routing replay; its guidance is the model's own FP4 quantization of the same batch,
captured once before timing (so guided rounding reproduces it, as with a real engine).

    python bench/train_step.py                                   # tiny model on the CPU
    python bench/train_step.py --model qwen3-30b-a3b --layers 4 --tokens 16384 --record   # on a GPU

--record writes bench/results/train_step.json (rows: mode, step_s, tokens_per_s, gpu, date, ...)
and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _init():
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_trace.megatron.cpu_patches import initialize_model_parallel_cpu

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    initialize_model_parallel_cpu()  # the CPU patches apply only without CUDA


def sync_sites(fn, *args) -> collections.Counter:
    """Call fn(*args) under torch's CUDA sync debug mode; the synchronising operations it ran, counted by
    their innermost call site in TRACE, Megatron or TE (or the innermost frame elsewhere)."""
    sites = collections.Counter()
    ours = ("megatron_trace", "trace_kernels", "megatron/", "transformer_engine", "kernels/")

    def note(message, *_args, **_kwargs):
        frames = traceback.extract_stack()[:-2]
        frame = next((f for f in reversed(frames) if any(k in f.filename for k in ours)), frames[-1])
        where = "/".join(frame.filename.split("/")[-2:])
        sites[f"{where}:{frame.lineno} {frame.name}: {str(message).split('.')[0][:60]}"] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*args)
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return sites


def own_guidance(model, ids, pos, psp, cfg):
    """Dense guidance for every site and layer from the model's own FP4 forward (fp4 mode):
    site rows in the canonical order of MicroBatchGuidance, plus the routed experts.
    Returns (MicroBatchGuidance, {(layer, site): (codes uint8 [R, K], scale bytes [R, K/16])})."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_trace.guidance.rows import RowGuidance
    from megatron_trace.megatron import qat
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import set_precision
    from trace_kernels.fp4 import pack_bits, unpack_codes

    set_precision(model, "fp4-rne")
    rows: dict = {}
    qat.observers.append(lambda site, x, q, g: rows.setdefault((site.layer, site.name), []).append(q))
    routers = [layer.mlp.router.router_replay for layer in model.decoder.layers]
    for r in routers:
        r.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(ids, pos, None, packed_seq_params=psp)
    qat.observers.clear()
    n = ids.shape[1]
    sites, experts, captured = {}, {}, {}
    for layer, r in zip(model.decoder.layers, routers, strict=True):
        li = layer.layer_number - 1
        top = r.get_recorded_indices()
        experts[li] = top.long()
        r.clear_router_replay_action()
        # expert rows arrive sorted by expert, tokens ascending: map them back to (token, slot)
        tok, slot = _expert_order(top)
        for name in ("qkv", "k", "v", "proj", "fc1", "fc2"):
            qs = rows[(li, name)]
            q = qs[0] if len(qs) == 1 else None
            codes = torch.cat([unpack_codes(x.codes) for x in qs]) if q is None else unpack_codes(q.codes)
            scales = torch.cat([x.block_scales for x in qs]) if q is None else q.block_scales
            g = torch.cat([x.global_scale for x in qs]) if q is None else q.global_scale
            if name == "fc2":  # dispatched (token, expert) rows -> canonical (token, slot) rows
                canon = torch.empty(n * cfg.top_k, dtype=torch.long, device=tok.device)
                canon[tok * cfg.top_k + slot] = torch.arange(len(tok), device=tok.device)
                codes, scales, g = codes[canon], scales[canon], g[canon]
            sites[(li, name)] = RowGuidance(g=g.reshape(-1, 1), scales=scales.view(torch.uint8).contiguous(),
                                            bits=pack_bits(codes & 1)).with_row_ids()
            captured[(li, name)] = (codes, scales.view(torch.uint8))
    return MicroBatchGuidance(n, sites, experts), captured


def reproduces(model, ids, pos, psp, guidance, captured) -> bool:
    """Whether a trace-mode forward rounds every site's rows to the captured codes."""
    from megatron_trace.megatron import qat
    from megatron_trace.megatron.model import set_precision
    from trace_kernels.fp4 import unpack_codes

    bad = []

    def check(site, x, q, g):
        codes, scales = captured[(site.layer, site.name)]
        got, want = unpack_codes(q.codes), codes[g.row_ids]
        same_code = (got == want) | (((got & 7) == 0) & ((want & 7) == 0))  # -0 == +0
        if not (bool(same_code.all()) and torch.equal(q.block_scales.view(torch.uint8), scales[g.row_ids])):
            bad.append((site.layer, site.name))

    set_precision(model, "fp4-guided")
    qat.observers.append(check)
    try:
        with torch.no_grad():
            model(ids, pos, None, packed_seq_params=psp, guidance=guidance)
    finally:
        qat.observers.clear()
    if bad:
        print(f"sites whose codes differ from the captured ones: {bad}")
    return not bad


def _expert_order(top: torch.Tensor):
    """(token, slot) of each dispatched row, in Megatron's permuted order (expert-major)."""
    e_flat = top.reshape(-1)
    order = torch.argsort(e_flat * top.numel() + torch.arange(top.numel(), device=top.device))
    return order // top.shape[1], order % top.shape[1]


def packed_batch(cfg, tokens: int, seq_len: int, dev):
    """Random token ids as tokens // seq_len packed sequences: (input_ids, position_ids int64
    [1, tokens], PackedSeqParams, labels = next token int64 [1, tokens])."""
    from megatron.core.packed_seq_params import PackedSeqParams

    n_seq = tokens // seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=dev)
    pos = torch.arange(seq_len, device=dev).repeat(n_seq)[None]
    cu = (torch.arange(n_seq + 1, device=dev) * seq_len).int()
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq_len,
                          max_seqlen_kv=seq_len)
    return ids, pos, psp, torch.roll(ids, -1, 1)


def _gib(v):
    return "" if v is None else f"{v:.1f}"


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every training-step benchmark takes: --model, --layers, --tokens, --seq-len."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    return ap


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def write_trace(step, mode: str, path: Path) -> Path:
    """One step(mode, 1) under torch's profiler (host ops with Python stacks; kernels on a GPU),
    written to `path` as a gzipped Chrome trace."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=True) as prof:
        step(mode, 1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("")
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    return path


def step_flops(cfg, tokens: int, seq_len: int) -> float:
    """Model FLOPs of one micro-batch's forward + backward (3x the forward): 2 per weight a token
    multiplies (routed experts: top_k of them, the output layer, the router; no embedding), plus
    causal attention's QK^T and PV over packed sequences of seq_len (each token sees (seq_len + 1)
    / 2 keys on average)."""
    from megatron_trace.model_config import full_weight_shapes

    per_token = 0.0
    for name, shape in full_weight_shapes(cfg).items():
        if len(shape) != 2 or name.startswith("embedding."):
            continue
        share = cfg.top_k / cfg.num_experts if ".mlp.experts." in name else 1.0
        per_token += 2 * shape[0] * shape[1] * share
    qk = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) if cfg.mla else cfg.head_dim
    v = cfg.v_head_dim if cfg.mla else cfg.head_dim
    per_token += cfg.num_layers * 2 * cfg.num_attention_heads * (qk + v) * (seq_len + 1) / 2
    return 3 * per_token * tokens


def matmul_rate(dev) -> float | None:
    """BF16 FLOP/s of cuBLAS on this GPU, the ceiling a step's FLOPs are held against: the best of
    a few large square GEMMs (median of triton.testing.do_bench each). None on the CPU."""
    if dev.type != "cuda":
        return None
    import triton.testing

    best = 0.0
    for n in (4096, 8192, 16384):
        a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
        ms = triton.testing.do_bench(lambda a=a, b=b: a @ b, warmup=25, rep=200, return_mode="median")
        best = max(best, 2 * n**3 / (ms / 1e3))
    return best


def step_ratios(rows: list[dict]) -> list[str]:
    """The step-time ratios of one run: fp4-rne / bf16 and fp4-guided / fp4-rne per layer
    implementation and micro-batch count, and transformer_engine / local per mode."""
    out = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for mb in sorted({r["micro_batches"] for r in rows}):
            by = {r["mode"]: r["step_s"] for r in rows if r["micro_batches"] == mb and r["impl"] == impl}
            if "fp4-rne" in by and "bf16" in by:
                out.append(f"{impl}, {mb} micro-batch(es): fp4-rne / bf16 = {by['fp4-rne'] / by['bf16']:.3f} "
                           "(goal <= 1.10)")
            if "fp4-guided" in by and "fp4-rne" in by:
                out.append(f"{impl}, {mb} micro-batch(es): fp4-guided / fp4-rne = "
                           f"{by['fp4-guided'] / by['fp4-rne']:.3f} (goal <= 1.03)")
    for r in rows:
        if r["mode"] == "bf16" and r.get("matmul_fraction") is not None:
            out.append(f"{r['impl']}, {r['micro_batches']} micro-batch(es): bf16 step at "
                       f"{100 * r['matmul_fraction']:.1f}% of the measured BF16 matmul rate "
                       f"({r['model_tflops_per_s']:.0f} of {r['matmul_tflops_per_s']:.0f} TFLOP/s; goal >= 40%)")
    local = {(r["mode"], r["micro_batches"]): r["step_s"] for r in rows if r["impl"] == "local"}
    for r in rows:
        if r["impl"] == "transformer_engine" and (r["mode"], r["micro_batches"]) in local:
            out.append(f"{r['mode']}, {r['micro_batches']} micro-batch(es): transformer_engine / local = "
                       f"{r['step_s'] / local[r['mode'], r['micro_batches']]:.3f}")
    return out


def main() -> None:
    ap = shape_parser(__doc__)
    ap.add_argument("--modes", default="bf16,fp4-rne,fp4-guided", help="trainer precisions")
    ap.add_argument("--micro-batches", default="1",
                    help="comma list: forward+backward passes per optimizer step (weights quantized once per step)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step per mode")
    ap.add_argument("--trace", metavar="DIR", help="write a gzipped Chrome trace of one step per mode (host ops with "
                    "their Python stacks, kernels) to DIR/train_step_<impl>_<mode>.json.gz, for bench/trace_gaps.py")
    ap.add_argument("--sync-sites", action="store_true",
                    help="print where one step per mode waits for the GPU (torch's sync debug mode), by call site")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sequential-experts", action="store_true", help="SequentialMLP instead of grouped GEMMs")
    ap.add_argument("--transformer-impl", default="local",
                    help="comma list of Megatron's layer implementations: local, transformer_engine (TE's linears "
                         "under TRACE's recipe; a GPU with TE)")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--megatron", default="{}", help="Megatron TransformerConfig settings, as trainer.megatron "
                    "(YAML), e.g. '{cross_entropy_loss_fusion: true, cross_entropy_fusion_impl: native}'")
    args = ap.parse_args()
    if args.tokens % args.seq_len:
        sys.exit(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")

    _init()
    from tqdm import tqdm

    from megatron_trace.megatron.context import checks_read_at_end
    from megatron_trace.megatron.model import build_model, set_precision
    from megatron_trace.megatron.qat import cached_weights
    from megatron_trace.megatron.trainer import linears_for
    from megatron_trace.model_config import PRESETS

    cfg = PRESETS[args.model].replace(num_layers=args.layers)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ids, pos, psp, labels = packed_batch(cfg, args.tokens, args.seq_len, dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    rows, profiles = [], []  # profiles: --profile's tables, one per implementation and mode
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    rate, flops = matmul_rate(dev), step_flops(cfg, args.tokens, args.seq_len)
    for impl in args.transformer_impl.split(","):
        model = build_model(cfg, "bf16", grouped_gemm=not args.sequential_experts, linears=linears_for(impl),
                            megatron_options=yaml.safe_load(args.megatron))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **({"fused": True} if dev.type == "cuda" else {}))
        guidance, captured = own_guidance(model, ids, pos, psp, cfg)
        print(f"{impl}: guided forward reproduces every captured code: "
              f"{reproduces(model, ids, pos, psp, guidance, captured)}")

        def step(mode, micro_batches, model=model, opt=opt, guidance=guidance):
            # as the trainer's run_microbatches: guided forwards' deferred checks read once a step
            with cached_weights(), checks_read_at_end():
                for _ in range(micro_batches):
                    loss = model(ids, pos, None, labels=labels, packed_seq_params=psp,
                                 guidance=guidance if mode == "fp4-guided" else None).float().mean()
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for mb in (int(v) for v in args.micro_batches.split(",")):
            for mode in args.modes.split(","):
                set_precision(model, mode)
                times = []
                for i in tqdm(range(args.warmup + args.steps), desc=f"{impl} {mode} x{mb}", leave=False):
                    sync()
                    t0 = time.perf_counter()
                    step(mode, mb)
                    sync()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
                step_tokens = args.tokens * mb
                rows.append({"mode": mode, "impl": impl, "step_s": t, "tokens_per_s": step_tokens / t, "gpu": gpu,
                             "date": datetime.date.today().isoformat(), "model": args.model, "layers": args.layers,
                             "tokens": args.tokens, "micro_batches": mb, "seq_len": args.seq_len,
                             "experts": "sequential" if args.sequential_experts else "grouped", "peak_gib": peak,
                             "model_tflops_per_s": flops * mb / t / 1e12,
                             "matmul_tflops_per_s": rate / 1e12 if rate else None,
                             "matmul_fraction": flops * mb / t / rate if rate else None})
                print(f"{impl:18s} {mode:10s} x{mb} step {t * 1e3:9.1f} ms   {step_tokens / t:10.0f} tokens/s",
                      flush=True)
        if args.profile and dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            for mode in args.modes.split(","):
                set_precision(model, mode)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                    step(mode, 1)
                    sync()
                table = prof.key_averages()
                shaped = prof.key_averages(group_by_input_shape=True)
                profiles.append("\n".join([
                    f"--- {impl} {mode}: top CUDA kernels of one step",
                    table.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
                    f"--- {impl} {mode}: torch operations by input shape (self GPU time): what the kernels serve",
                    shaped.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=40,
                                 max_shapes_column_width=70),
                    f"--- {impl} {mode}: top host operations of one step (self CPU time)",
                    table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)]))
                print(profiles[-1])
        if args.trace:
            for mode in args.modes.split(","):
                set_precision(model, mode)
                path = write_trace(step, mode, Path(args.trace) / f"train_step_{impl}_{mode}.json.gz")
                print(f"--- {impl} {mode}: trace of one step in {path}")
        if args.sync_sites and dev.type == "cuda":
            for mode in args.modes.split(","):
                set_precision(model, mode)
                print(f"--- {impl} {mode}: host synchronisations of one step, by call site")
                for site, n in sync_sites(step, mode, 1).most_common(25):
                    print(f"{n:5d}  {site}")
        del model, opt, step
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    ratios = step_ratios(rows)
    print("\n".join(ratios))
    if args.record:
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = "train_step" if args.transformer_impl == "local" else "train_step_te"
        (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        cmd = "python bench/train_step.py " + " ".join(sys.argv[1:])
        lines = [f"# Training step time, {rows[0]['date']}, {gpu}", "", f"`{cmd}`", "",
                 f"{args.model} at full width, {args.layers} layers, micro-batches of {args.tokens} tokens "
                 f"(packed sequences of {args.seq_len}), {rows[0]['experts']} experts; a step is forward + backward "
                 "of each micro-batch and one AdamW step (FP4 weights quantized once per step).",
                 "", "| layer implementation | mode | micro-batches | step (ms) | tokens/s | model TFLOP/s | "
                 "of the BF16 matmul rate | peak GiB |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['impl']} | {r['mode']} | {r['micro_batches']} | {r['step_s'] * 1e3:.1f} | "
                  f"{r['tokens_per_s']:.0f} | {r['model_tflops_per_s']:.1f} | "
                  f"{_pct(r['matmul_fraction'])} | "
                  f"{_gib(r['peak_gib'])} |" for r in rows]
        lines += ["", *[f"- {r}" for r in ratios], ""]
        (RESULTS / f"{name}.md").write_text("\n".join(lines))
        if profiles:  # beside the table, dated: a later run's profile does not overwrite it
            tag = f"{rows[0]['date']}_{'h200' if 'H200' in gpu else 'gpu'}"
            (RESULTS / f"{name}_profile_{tag}.log").write_text(f"$ {cmd}\n\n" + "\n\n".join(profiles) + "\n")


if __name__ == "__main__":
    main()
