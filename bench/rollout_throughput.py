"""Decode throughput of the built-in engine, BF16 vs FP4, beside the memory-bandwidth floor.

A Qwen3-MoE-shaped model with random weights (`--model` width, `--layers` layers). For each
precision, batch and context, every sequence's KV cache holds `context` tokens (synthetic
content: decode speed does not depend on it) and one decode step for the whole batch is timed.
The floor is the time to read what a step must read at `--bandwidth` bytes/s: every attention
and router weight, the experts the batch's tokens reach (expected count for uniform routing),
the output head, and the KV cache of every sequence. FP4 weights count 4.5 bits (codes + E4M3
scales), the FP4 cache 4.5 bits per element + 4 bytes per (token, head).

    python bench/rollout_throughput.py                        # tiny model, CPU (a smoke run)
    python bench/rollout_throughput.py --model qwen3-30b-a3b --layers 4 --record    # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
COPY_BANDWIDTH = 4.25e12  # H200 device copy measured in bench/results/fp4_quantize_*_h200.md


def random_weights(cfg, device, seed=0, host: bool = False):
    """A random full state dict drawn on `device`; with `host`, each tensor is moved to host
    memory once drawn, so that the GPU holds only the engine's own copy (48 layers in BF16 take
    61 GB: two copies and an 8k cache do not fit one H200)."""
    from megatron_trace.model_config import full_weight_shapes

    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in full_weight_shapes(cfg).items():
        t = (torch.randn(shape, generator=g, device=device) * (shape[-1] ** -0.5 if len(shape) == 2 else 0.1)
             + (0 if len(shape) == 2 else 1)).to(torch.bfloat16 if len(shape) == 2 else torch.float32)
        out[name] = t.cpu() if host else t
    return out


# bytes per weight element and per K/V element, and extra bytes per (token, KV head) of K and V
# together: FP4 is codes + one E4M3 scale per 16 (4.5 bits) and a float32 global scale per row;
# FP8 (SGLang's `fp8` + FP8 KV) keeps per-channel or per-tensor scales, too few to count
FLOOR_BYTES = {"bf16": (2.0, 2.0, 0), "fp8": (1.0, 1.0, 0), "fp4": (0.5625, 0.5625, 8)}


def floor_seconds(cfg, batch, context, fmt: str, bandwidth):
    """Seconds one decode step must take at `bandwidth` bytes/s: every attention and router weight,
    the experts the batch's tokens reach (expected count under uniform routing), the output head
    (BF16), and every sequence's KV cache of `context` tokens, weights and cache in `fmt`
    ("bf16", "fp8" or "fp4")."""
    wbytes, kv_bytes, kv_head_extra = FLOOR_BYTES[fmt]
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + cfg.num_attention_heads * d * h
    expert = 3 * h * cfg.moe_intermediate_size
    touched = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** batch)
    per_layer = (attn + touched * expert) * wbytes + cfg.num_experts * h * 2
    kv_token = 2 * cfg.num_key_value_heads * d * kv_bytes + cfg.num_key_value_heads * kv_head_extra
    total = cfg.num_layers * (per_layer + batch * context * kv_token) + cfg.vocab_size * h * 2
    return total / bandwidth


def engine_weight_bytes(cfg, fp4: bool) -> float:
    """Bytes the engine's weights take: FP4 sites at 4.5 bits (codes + E4M3 scales), other
    matrices BF16, vectors FP32. The KV-cache budget leaves room for them."""
    from megatron_trace.model_config import full_weight_shapes
    from sglang_rollout.engine.weights import FP4_SUFFIXES

    return sum(math.prod(shape) * (0.5625 if fp4 and name.endswith(FP4_SUFFIXES) else 2 if len(shape) >= 2 else 4)
               for name, shape in full_weight_shapes(cfg).items())


def fill_cache(cache, seed: int = 0) -> None:
    """Random K/V in every slot (decode speed does not depend on the values, but never time on
    zeros: the MMAs run faster on them): codes any byte, block scales E4M3 bytes 0x20..0x47
    (2**-4 .. 15), global scales about 0.01; or BF16 rows ~ N(0, 1)."""
    g = torch.Generator(device=cache.k[0][next(iter(cache.k[0]))].device).manual_seed(seed)
    for layer in cache.k + cache.v:
        for name, t in layer.items():
            if name == "codes":
                t.random_(0, 256, generator=g)
            elif name == "scales":
                t.random_(0x20, 0x48, generator=g)
            elif name == "g":
                t.uniform_(0.005, 0.015, generator=g)
            else:
                t.normal_(generator=g)


def goal_line(rows, batch: int = 64, context: int = 8192) -> str:
    """The issue's goals at one batch and context: FP4 / BF16 tokens/s (goal >= 2) and FP4's
    distance from its bandwidth floor (goal <= 2), for each way of running the step measured."""
    def pick(precision, mode):
        return next((r for r in rows if (r["precision"], r["batch"], r["context"], r["mode"]) ==
                     (precision, batch, context, mode) and r["tokens_per_s"]), None)
    parts = []
    for mode, key in (("eager", "tokens_per_s"), ("cuda_graph", "tokens_per_s"), ("cuda_graph", "gpu_tokens_per_s")):
        fp4, bf16 = pick("fp4", mode), pick("bf16", mode)
        if fp4 and bf16 and fp4.get(key) and bf16.get(key):
            name = mode + (" replay alone" if key == "gpu_tokens_per_s" else "")
            parts.append(f"{name}: FP4 / BF16 = {fp4[key] / bf16[key]:.2f}, FP4 at "
                         f"{fp4['floor_tokens_per_s'] / fp4[key]:.1f}x its floor")
    if not parts:
        return f"(batch {batch} / context {context} not measured)"
    return f"Goals at batch {batch} / context {context} (FP4 / BF16 >= 2, FP4 within 2x of its floor): " + \
        "; ".join(parts) + "."


def replay_seconds(graph, reps: int) -> list[float]:
    """Seconds of `reps` replays of a captured decode step, each timed with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def token_ids(batch: int, step: int, cfg) -> list[int]:
    """A different random token for every sequence and step: with one shared token the batch's
    hidden states are alike and route to the same few experts, which the floor's uniform routing
    does not assume (and a real batch does not do)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab_size, (batch,), generator=g).tolist()


def kernel_table(segments, step_fn, title: str, top: int = 24) -> str:
    """GPU time per kernel of one step (torch.profiler), largest first, as a markdown table."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_fn(segments)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    launches = sum(e.count for e in events)
    lines = [f"### {title}: {total / 1e3:.3f} ms of kernels, {launches} launches", "",
             "| kernel | calls | ms | share |", "|---|---|---|---|"]
    for e in events[:top]:
        lines.append(f"| {e.key[:70]} | {e.count} | {e.self_device_time_total / 1e3:.3f} | "
                     f"{e.self_device_time_total / total:.1%} |")
    rest = events[top:]
    if rest:
        ms = sum(e.self_device_time_total for e in rest)
        lines.append(f"| ({len(rest)} other kernels) | {sum(e.count for e in rest)} | {ms / 1e3:.3f} | "
                     f"{ms / total:.1%} |")
    return "\n".join(lines) + "\n"


def time_generate(engine, cfg, batch: int, prompt_len: int, new_tokens: int, samples: int = 8, reps: int = 3,
                  profile: bool = False):
    """The time of an `engine.generate` call, what the RL loop runs: batch /
    samples random prompts of prompt_len tokens, `samples` samples each (a GRPO group), drawn
    at temperature 1 up to new_tokens (random weights emit no stop token). Prefill, scheduling,
    sampling and the host's bookkeeping are all in the time: the median of `reps` calls (single
    calls on the H200 machines spread by up to 25%, bench/results/overlap_spread_*). First the
    decode CUDA graphs up to `batch` are captured (capturing inside a timed call cost seconds at
    48 layers) and a short call compiles the prefill and sampling kernels. `profile`: one more
    call runs under cProfile, and its host functions by own time are returned as text (else
    None). Returns (seconds, tokens, that text)."""
    from megatron_trace.rollout import GroupRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    requests = [GroupRequest(f"g{i}", tuple(torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()),
                             n=samples) for i in range(max(1, batch // samples))]
    if engine.graphs is not None:  # the buckets a ramp-up to `batch` passes through, not all of them
        for b in range(1, batch + 1):
            engine.graphs.get(b)
    engine.generate(requests, SamplingParams(max_new_tokens=min(new_tokens, 4), seed=1))
    seconds = []
    for rep in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(requests, SamplingParams(max_new_tokens=new_tokens, seed=rep))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        print(f"  generate call {rep + 1}/{reps}: {seconds[-1]:.2f} s", flush=True)
        errors = {s.error for s in out.samples if s.error}
        if errors:
            raise SystemExit(f"--generate {batch}:{prompt_len}:{new_tokens}: {sorted(errors)}")
    table = None
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(engine.generate, requests, SamplingParams(max_new_tokens=new_tokens, seed=reps))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats("tottime").print_stats(25)
        table = (f"one call under cProfile: {time.perf_counter() - t0:.2f} s (the profiler slows the host)\n"
                 + text.getvalue())
    return statistics.median(seconds), sum(len(s.tokens) for s in out.samples), table


def write_record(rows, profiles, args, cfg, gpu) -> None:
    """bench/results/rollout_throughput.{json,md} from the rows so far (rewritten after every
    case, so that a run cut short keeps what it measured)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rollout_throughput.json").write_text(json.dumps(rows, indent=1) + "\n")
    cmd = "python bench/rollout_throughput.py " + " ".join(sys.argv[1:])
    lines = [f"# Decode throughput, {rows[0]['date']}, {gpu}", "", f"`{cmd}`", "",
             f"{args.model} width, {cfg.num_layers} layers, random weights; floor at {args.bandwidth / 1e12:.2f} TB/s.",
             "",
             "Decode `eager` runs the step's kernels from Python; `cuda_graph` replays the step as a CUDA "
             "graph (what the engine does), and tokens/s counts the host's preparation of the step too; "
             "`replay alone` is the graph replay timed with CUDA events, the GPU's share. `generate` is "
             "a whole `engine.generate` call (`--generate batch:prompt:new`, GRPO groups of 8, temperature 1, "
             "median of 3): "
             "prefill, scheduling and sampling included; its context is the prompt plus half the new tokens. "
             "`generate_serial` is the same call with `EngineConfig.overlap` off: each step's results taken in "
             "before the next step is launched.", "",
             "| precision | batch | context | decode | tokens/s | replay alone | floor tokens/s | floor / measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps, floor = r["tokens_per_s"], r["floor_tokens_per_s"]
        measured = "does not fit" if tps is None else f"{tps:.1f}"
        ratio = "" if tps is None else f"{floor / tps:.1f}"
        replay = "" if r.get("gpu_tokens_per_s") is None else f"{r['gpu_tokens_per_s']:.1f}"
        lines.append(f"| {r['precision']} | {r['batch']} | {r['context']} | {r['mode']} | {measured} | {replay} | "
                     f"{floor:.1f} | {ratio} |")
    lines += ["", goal_line(rows)]
    if profiles:
        lines += ["", "## Profiles: GPU time per kernel of one eager step; host time of a generate call", ""] + profiles
    (RESULTS / "rollout_throughput.md").write_text("\n".join(lines) + "\n")
    plot(rows, RESULTS / "rollout_throughput.png")


def plot(rows, path: Path) -> None:
    """tokens/s against batch, one panel per context: BF16 and FP4 as the engine runs them (CUDA
    graphs where measured, else eager), each beside its bandwidth floor. Log-log PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r["mode"].startswith("generate")]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for precision, color in (("bf16", "tab:blue"), ("fp4", "tab:red")):
            mine = [r for r in rows if r["context"] == context and r["precision"] == precision and r["tokens_per_s"]]
            mode = "cuda_graph" if any(r["mode"] == "cuda_graph" for r in mine) else "eager"
            pts = sorted((r["batch"], r["tokens_per_s"], r["floor_tokens_per_s"]) for r in mine if r["mode"] == mode)
            if not pts:
                continue
            b, tps, floor = zip(*pts, strict=True)
            ax.plot(b, tps, "o-", color=color, label=f"{precision} ({mode})")
            ax.plot(b, floor, "--", color=color, alpha=0.6, label=f"{precision} bandwidth floor")
        ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="decode tokens/s",
               title=f"context {context}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['model']} width, {rows[0]['layers']} layers, {rows[0]['gpu']}, {rows[0]['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--precisions", default="bf16,fp4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bandwidth", type=float, default=COPY_BANDWIDTH)
    ap.add_argument("--host-weights", action="store_true",
                    help="keep the random state dict in host memory (the GPU then holds only the engine's weights)")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="KV-cache budget (default: 60%% of the memory left free by the engine's weights)")
    ap.add_argument("--cuda-graphs", action="store_true", help="also time decode replayed as a CUDA graph")
    ap.add_argument("--profile", default="", help="batch sizes (e.g. 64) whose GPU time per kernel is printed "
                    "and recorded, for one eager step (torch.profiler)")
    ap.add_argument("--generate", default="", metavar="BATCH:PROMPT:NEW",
                    help="also time whole engine.generate calls (e.g. 64:128:256), sampling included")
    ap.add_argument("--generate-reps", type=int, default=3, help="timed generate calls per case (the median)")
    ap.add_argument("--generate-modes", default="generate,generate_serial",
                    help="generate (steps overlapped, as the engine runs) and/or generate_serial")
    ap.add_argument("--generate-profile", action="store_true",
                    help="one more overlapped generate call under cProfile: the host's functions by own time")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the recorded JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "rollout_throughput.json").read_text()), RESULTS / "rollout_throughput.png")
        return
    args.profile_batches = {int(v) for v in args.profile.split(",") if v}
    profiles: list[str] = []

    from tqdm import tqdm

    from megatron_trace.model_config import PRESETS
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from sglang_rollout.engine.cuda_graphs import DecodeGraph
    from sglang_rollout.engine.kv_cache import PagedKVCache
    from sglang_rollout.engine.model import Segment

    cfg = PRESETS[args.model]
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    batches = [int(v) for v in args.batches.split(",") if v]  # empty: no decode table (e.g. --generate alone)
    contexts = [int(v) for v in args.contexts.split(",") if v]
    generate = [int(v) for v in args.generate.split(":")] if args.generate else []
    if generate and len(generate) != 3:
        raise SystemExit(f"--generate {args.generate!r}: expected BATCH:PROMPT:NEW")
    unknown = set(args.generate_modes.split(",")) - {"generate", "generate_serial"}
    if unknown or args.generate_reps < 1:
        raise SystemExit(f"--generate-modes {sorted(unknown)} / --generate-reps {args.generate_reps}: expected "
                         "generate,generate_serial and at least 1")
    weights = random_weights(cfg, device, host=args.host_weights)
    rows = []
    for precision in args.precisions.split(","):
        block = 16
        # a one-block cache gives the bytes per token (an engine would also allocate the weights)
        per_block = PagedKVCache(cfg.num_layers, 1, block, cfg.num_key_value_heads, cfg.head_dim,
                                 precision == "fp4", device).nbytes_per_token() * block
        free = torch.cuda.mem_get_info()[0] if cuda else 8 * 2**30
        budget = (args.memory_gib * 2**30) if args.memory_gib else \
            0.6 * (free - engine_weight_bytes(cfg, precision == "fp4"))
        num_blocks = int(budget // per_block)
        engine = TraceEngine(cfg, EngineConfig(precision=precision, block_size=block, num_blocks=num_blocks,
                                               max_batch_tokens=max([2048] + batches + generate[:2]), device=device))
        engine.update_weights(weights, 0)
        fill_cache(engine.cache)
        step_fn = None
        for context in contexts:
            for batch in batches:
                need = batch * math.ceil((context + args.warmup + args.steps + 1) / block)
                row = {"precision": precision, "batch": batch, "context": context, "gpu": gpu,
                       "date": datetime.date.today().isoformat(), "model": args.model, "layers": cfg.num_layers,
                       "floor_tokens_per_s": batch / floor_seconds(cfg, batch, context, precision,
                                                                   args.bandwidth)}
                if need + 1 > engine.cache.allocator.num_free:
                    row |= {"tokens_per_s": None, "mode": "eager",
                            "note": f"KV cache does not fit ({need} blocks of {num_blocks})"}
                    rows.append(row)
                    print(f"{precision:5s} batch {batch:4d} context {context:5d}: does not fit", flush=True)
                    continue
                tables = [engine.cache.allocator.allocate(need // batch) for _ in range(batch)]
                modes = ["eager"] + (["cuda_graph"] if args.cuda_graphs and cuda else [])
                for mode in modes:
                    if mode == "cuda_graph":
                        (scratch,) = engine.cache.allocator.allocate(1)
                        graph = DecodeGraph(engine.runner, batch, need // batch, scratch)
                        step_fn = graph.run
                    else:
                        step_fn = engine.runner.forward
                    times = []
                    for i in tqdm(range(args.warmup + args.steps), desc=f"{precision} b{batch} c{context} {mode}",
                                  leave=False):
                        segs = [Segment([tok], context + i, t)
                                for tok, t in zip(token_ids(batch, i, cfg), tables, strict=True)]
                        if cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        step_fn(segs)
                        if cuda:
                            torch.cuda.synchronize()
                        if i >= args.warmup:
                            times.append(time.perf_counter() - t0)
                    if args.profile and mode == "eager" and batch in args.profile_batches:
                        profiles.append(kernel_table([Segment([tok], context + args.warmup + args.steps, t)
                                            for tok, t in zip(token_ids(batch, -1, cfg), tables, strict=True)],
                                           step_fn, f"{precision} b{batch} c{context}"))
                        print(profiles[-1], flush=True)
                    replay_s = None
                    if mode == "cuda_graph":  # the GPU's share of a step: the replay alone, host work left out
                        replay_s = statistics.median(replay_seconds(graph.graph, args.steps))
                        del graph
                        engine.cache.allocator.release([scratch])
                    step = statistics.median(times)
                    r = dict(row, mode=mode, tokens_per_s=batch / step, step_s=step,
                             gpu_tokens_per_s=None if replay_s is None else batch / replay_s)
                    rows.append(r)
                    floor = r["floor_tokens_per_s"]
                    replay_note = "" if replay_s is None else f", replay alone {batch / replay_s:10.1f}"
                    print(f"{precision:5s} batch {batch:4d} context {context:5d} {mode:10s}: {batch / step:10.1f} "
                          f"tokens/s{replay_note} (floor {floor:10.1f}; {floor / (batch / step):6.1f}x slower)",
                          flush=True)
                for t in tables:
                    engine.cache.allocator.release(t)
                if args.record:
                    write_record(rows, profiles, args, cfg, gpu)
        if generate:
            batch, prompt_len, new_tokens = generate
            context = prompt_len + new_tokens // 2
            # the engine as it runs (overlapped steps), then with each step's results taken in
            # before the next is launched: the host's share that overlap hides
            for mode in args.generate_modes.split(","):
                engine.engine_cfg = dataclasses.replace(engine.engine_cfg, overlap=mode == "generate")
                seconds, generated, host = time_generate(engine, cfg, batch, prompt_len, new_tokens,
                                                         reps=args.generate_reps,
                                                         profile=args.generate_profile and mode == "generate")
                if host:
                    profiles.append(f"### host profile, {precision} generate {args.generate}\n\n```\n{host}```\n")
                    print(profiles[-1], flush=True)
                r = {"precision": precision, "batch": batch, "context": context, "gpu": gpu, "mode": mode,
                     "date": datetime.date.today().isoformat(), "model": args.model, "layers": cfg.num_layers,
                     "tokens_per_s": generated / seconds, "step_s": seconds, "new_tokens": new_tokens,
                     "floor_tokens_per_s": batch / floor_seconds(cfg, batch, context, precision,
                                                                 args.bandwidth)}
                rows.append(r)
                print(f"{precision:5s} batch {batch:4d} context {context:5d} {mode:10s}: {r['tokens_per_s']:10.1f} "
                      f"tokens/s ({generated} tokens in {seconds:.2f} s, prompts of {prompt_len})", flush=True)
                if args.record:
                    write_record(rows, profiles, args, cfg, gpu)
        del engine, step_fn  # step_fn may be engine.runner.forward, which keeps the weights and cache alive
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if args.record:
        write_record(rows, profiles, args, cfg, gpu)

if __name__ == "__main__":
    main()
