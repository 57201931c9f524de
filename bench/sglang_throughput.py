"""Rollout throughput of SGLang: BF16, FP8 (its own `fp8` + FP8 KV cache) and TRACE's FP4
(`trace_fp4`: W4A4 at every FP4 site, TRACE's NVFP4 KV cache, TRACE's attention backend; and
`trace_fp4_guided`: the same recording the dense guidance of the last `--guided-layers` layers
for every token, inside the decode CUDA graphs, what its capture costs), and TRACE's built-in
FP4 engine (`builtin`: `sglang_rollout.engine.TraceEngine`, CUDA graphs, chunked prefill of
`--max-batch-tokens`), one method for all: the same random prompts through each engine's
`generate`, timed the same way.

The model is Qwen3-30B-A3B's shape (`--layers` of it) with SGLang's dummy (random) weights,
CUDA graphs for decode only (SGLang's piecewise prefill graphs compile the model with
torch.compile: minutes of start-up, and not for TRACE's kernels), no radix cache (each
phase's prompts are new anyway), every request generating exactly its `max_new_tokens`
(ignore_eos). Phases, each with `--batch` requests:
  generate  P:N   whole generate of P-token prompts and N new tokens: N * batch / seconds
                  (after one untimed call of the same shape);
  decode    C     (after one unmeasured prefill of C-token prompts, which warms its kernels)
                  `--repeats` times: prompts of C tokens generating 1 token (t1), then other
                  prompts of C tokens generating 1 + `--decode-tokens` (t2); decode tok/s =
                  batch * decode_tokens / (median t2 - median t1) (the whole generate of t2 is
                  reported too). At 8k an FP4 prefill of 64 prompts varies by a second or more
                  between calls (2026-12-05: 3663 and 1898 tok/s from single pairs), so the
                  decode tokens and the repeats must outweigh it. SGLang's engines also
                  stream one more such call: `streamed_tok_s` counts only the tokens after
                  every request has its first one, over the time after that (no prefill in it).
The built-in engine captures all its decode graphs at start, as SGLang does (start_s holds both).
`--profile-steps N` then runs SGLang's own profiler over the first N prefill chunks and decode
steps at the longest context and writes the GPU time per kernel (`profile_<engine>_<C>/kernels.md`
beside `--out`). One engine per process (`--engine`); JSON lines appended to `--out`. `--report` turns the JSON
lines of a run into a markdown table beside each engine's decode bandwidth floor.

    bash .sglrun/run.sh bench/sglang_throughput.py --engine trace_fp4 --out $OUT/sglang.jsonl  # GPU
    python bench/sglang_throughput.py --report bench/results/sglang_throughput_<date>_h200.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

torch = None  # imported in main(): SGLang's run.sh sets up the environment first
ROOT = Path(__file__).resolve().parents[1]
ENGINES = {
    "bf16": {},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    "trace_fp4": {"quantization": "trace_fp4", "attention_backend": "trace_fp4"},
    "trace_fp4_guided": {"quantization": "trace_fp4", "attention_backend": "trace_fp4"},
    "builtin": {},  # TRACE's own engine, not SGLang
}


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def timed(engine, ids, new_tokens: int) -> float:
    """Seconds of one generate call (temperature 1, no stop token); checks that every request
    got all its tokens."""
    t0 = time.perf_counter()
    if isinstance(engine, BuiltinEngine):
        lengths = engine.generate(ids, new_tokens)
    else:
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        lengths = [len(o["output_ids"]) for o in engine.generate(input_ids=ids, sampling_params=params)]
    seconds = time.perf_counter() - t0
    _check_lengths(lengths, new_tokens)
    return seconds


def streamed_decode(engine, ids, new_tokens: int) -> tuple[float, float | None]:
    """(seconds of the whole call, decode tok/s) of one streamed SGLang generate call: decode
    counts the tokens produced after every request has its first token (all prefills done)
    over the time from then to the last token, so no prefill is in it."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    done = [0] * len(ids)
    t0 = time.perf_counter()
    first_all, at_first = None, 0
    for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
        done[chunk["index"]] = chunk["meta_info"]["completion_tokens"]
        if first_all is None and min(done) > 0:
            first_all, at_first = time.perf_counter(), sum(done)
    end = time.perf_counter()
    _check_lengths(done, new_tokens)
    if first_all is None or end <= first_all:  # every token arrived in one chunk: no decode to time
        return end - t0, None
    return end - t0, (sum(done) - at_first) / (end - first_all)


def _check_lengths(lengths: list[int], new_tokens: int) -> None:
    short = [n for n in lengths if n != new_tokens]
    if short:
        raise RuntimeError(f"requests ended early: {short[:4]} of {new_tokens} tokens")


class BuiltinEngine:
    """TRACE's built-in FP4 engine behind the same calls: one request per prompt (groups of
    one, as SGLang gets them), temperature 1, no stop token, the KV cache sized for `batch`
    sequences of `longest` tokens. Its random BF16 weights are drawn on the GPU, kept on the
    host, and quantized by `update_weights` as a trainer's would be."""

    def __init__(self, cfg, batch: int, longest: int, max_batch_tokens: int):
        from bench.rollout_throughput import random_weights
        from sglang_rollout.engine import EngineConfig, TraceEngine

        block, device = 16, "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run
        self.engine = TraceEngine(cfg, EngineConfig(precision="fp4", block_size=block, device=device,
                                                    num_blocks=batch * -(-longest // block) + 1,
                                                    max_batch_tokens=max_batch_tokens, cuda_graph_max_batch=batch))
        self.engine.update_weights(random_weights(cfg, device, host=True), 0)
        self.engine.capture_graphs()
        self.calls = 0

    def generate(self, ids: list[list[int]], new_tokens: int) -> list[int]:
        from megatron_trace.rollout import GroupRequest, SamplingParams

        self.calls += 1
        requests = [GroupRequest(f"c{self.calls}r{i}", tuple(p)) for i, p in enumerate(ids)]
        out = self.engine.generate(requests, SamplingParams(max_new_tokens=new_tokens, seed=self.calls))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        errors = {s.error for s in out.samples if s.error}
        if errors:
            raise RuntimeError(f"the built-in engine failed requests: {sorted(errors)}")
        return [len(s.tokens) for s in out.samples]

    def shutdown(self) -> None:
        del self.engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=sorted(ENGINES))
    p.add_argument("--report", type=Path, help="write the markdown table of these JSON lines (no engine runs)")
    p.add_argument("--bandwidth", type=float, default=4.25e12, help="--report: bytes/s of the decode floor")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--generate", default="128:128", help="P:N cases, comma-separated ('' for none)")
    p.add_argument("--decode", default="1024,8192", help="contexts, comma-separated ('' for none)")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="decode: (t1, t2) pairs per context, medians taken")
    p.add_argument("--attention", default="flashinfer", help="attention backend of the bf16 and fp8 engines")
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=1, help="SGLang's page_size (16: TRACE's CUDA split-K attention)")
    p.add_argument("--guided-layers", type=int, default=8, help="trace_fp4_guided: guidance of the last K layers")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="SGLang engines: profile this many prefill chunks and decode steps at the longest "
                        "context (SGLang's profiler) and print GPU time per kernel")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="builtin: new tokens per forward (its prefill chunk; SGLang's own default is 8192 here)")
    p.add_argument("--out", type=Path, help="JSON lines appended here (required with --engine)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.report:
        print(report(args.report, args.bandwidth))
        print(f"plot: {plot(args.report, args.bandwidth)}")
        return
    if args.engine is None or args.out is None or args.repeats < 1:
        p.error("--engine and --out are required (or --report), and --repeats must be at least 1")
    if args.profile_steps + 2 > args.decode_tokens:
        p.error(f"--profile-steps {args.profile_steps} needs --decode-tokens of at least {args.profile_steps + 2}")
    global torch
    import torch

    if args.engine != "builtin":
        import sglang

    from megatron_trace.checkpoint.hf_layout import hf_config
    from megatron_trace.model_config import PRESETS

    cfg = PRESETS["qwen3-30b-a3b"].replace(num_layers=args.layers)
    if args.engine == "trace_fp4_guided":  # read by TRACE's plugin in SGLang's scheduler processes
        from sglang_rollout.sglang import capture

        guided = list(range(max(0, args.layers - args.guided_layers), args.layers))
        os.environ[capture.ENV] = json.dumps({"layers": guided, "coding": "dense"})
    contexts = [int(c) for c in args.decode.split(",") if c]
    cases = [tuple(int(x) for x in c.split(":")) for c in args.generate.split(",") if c]
    longest = max([c + args.decode_tokens + 1 for c in contexts] + [a + b for a, b in cases])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record = {"engine": args.engine, "gpu": gpu, "layers": args.layers, "batch": args.batch,
              "sglang": None if args.engine == "builtin" else sglang.__version__,
              "date": time.strftime("%Y-%m-%d"), "page_size": args.page_size}
    if args.engine == "trace_fp4_guided":
        record["guided_layers"] = min(args.guided_layers, args.layers)
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(hf_config(cfg) | {"max_position_embeddings": 40960}))
        options = dict(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                       random_seed=0, log_level="error", disable_radix_cache=True, attention_backend=args.attention,
                       mem_fraction_static=args.mem_fraction, max_running_requests=args.batch,
                       cuda_graph_max_bs_decode=args.batch, page_size=args.page_size,
                       cuda_graph_backend_prefill="disabled", context_length=longest + 16,
                       max_total_tokens=args.batch * (longest + 16)) | ENGINES[args.engine]
        t0 = time.perf_counter()
        if args.engine == "builtin":
            record |= {"max_batch_tokens": args.max_batch_tokens, "page_size": 16}
            engine = BuiltinEngine(cfg, args.batch, longest, args.max_batch_tokens)
        else:
            engine = sglang.Engine(**options)
        record["start_s"] = round(time.perf_counter() - t0, 1)
        if args.engine != "builtin":
            # the KV tokens SGLang's pool holds against what `batch` sequences of `longest` tokens
            # need: below it, the 8k phases run in waves and their decode figures mix batch sizes
            record |= {"kv_tokens": engine.get_server_info().get("max_total_num_tokens"),
                       "kv_tokens_needed": args.batch * longest}
        print(json.dumps(record), flush=True)
        try:
            timed(engine, prompts(args.batch, 64, cfg.vocab_size, 1), 8)  # warm-up
            seed = 10
            for p_len, n in cases:
                # an untimed call of the same shape first: a prefill chunk of a size not seen before
                # may build kernels or grow workspaces (2026-12-05b: TRACE FP4's first 64 x 128
                # prefill cost about 3 s, its 1k chunks 0.45 s each)
                timed(engine, prompts(args.batch, p_len, cfg.vocab_size, seed + 200), n)
                seconds = timed(engine, prompts(args.batch, p_len, cfg.vocab_size, seed), n)
                seed += 1
                row = record | {"phase": "generate", "prompt": p_len, "new": n, "seconds": round(seconds, 3),
                                "tok_s": round(args.batch * n / seconds, 1)}
                print(json.dumps(row), flush=True)
                _append(args.out, row)
            for c in contexts:
                # this prefill's kernels warm, and the built-in engine's mixed steps (decodes beside prefill
                # chunks): with one new token, 2026-12-06b's first 1k pair compiled them inside the timing
                timed(engine, prompts(args.batch, c, cfg.vocab_size, seed + 100), min(16, 1 + args.decode_tokens))
                t1s, t2s = [], []
                for _ in range(args.repeats):
                    t1s.append(timed(engine, prompts(args.batch, c, cfg.vocab_size, seed), 1))
                    t2s.append(timed(engine, prompts(args.batch, c, cfg.vocab_size, seed + 1), 1 + args.decode_tokens))
                    seed += 2
                t1, t2 = statistics.median(t1s), statistics.median(t2s)
                if args.engine != "builtin":  # the same phase streamed: decode with no prefill in it
                    _, streamed = streamed_decode(engine, prompts(args.batch, c, cfg.vocab_size, seed),
                                                  1 + args.decode_tokens)
                    record_stream = {"streamed_tok_s": None if streamed is None else round(streamed, 1)}
                else:
                    record_stream = {}
                row = record | record_stream | {"phase": "decode", "context": c, "new": args.decode_tokens,
                                                "prefill_s": round(t1, 3),
                                "generate_s": round(t2, 3), "prefill_runs_s": [round(t, 3) for t in t1s],
                                "generate_runs_s": [round(t, 3) for t in t2s],
                                "tok_s": round(args.batch * args.decode_tokens / (t2 - t1), 1) if t2 > t1 else None,
                                "generate_tok_s": round(args.batch * (1 + args.decode_tokens) / t2, 1)}
                print(json.dumps(row), flush=True)
                _append(args.out, row)
            if args.profile_steps and args.engine != "builtin":  # the built-in engine: rollout_throughput --profile
                c = max(contexts, default=1024)
                where = args.out.parent / f"profile_{args.engine}_{c}"
                # SGLang's profiler, by stage: the first N prefill chunks and the first N decode steps
                engine.start_profile(output_dir=str(where), num_steps=args.profile_steps, activities=["GPU"],
                                     profile_by_stage=True)
                timed(engine, prompts(args.batch, c, cfg.vocab_size, seed + 300), args.profile_steps + 3)
                time.sleep(5)  # the scheduler writes the traces as each stage's count is reached
                table = kernel_table(where, args.profile_steps)
                (where / "kernels.md").write_text(table)
                print(table, flush=True)
        finally:
            engine.shutdown()


NAMES = {"bf16": "SGLang BF16", "fp8": "SGLang FP8 + FP8 KV", "trace_fp4": "SGLang + TRACE FP4",
         "trace_fp4_guided": "SGLang + TRACE FP4, guided", "builtin": "TRACE built-in engine (FP4)"}
FLOOR_FORMAT = {"bf16": "bf16", "fp8": "fp8", "trace_fp4": "fp4", "trace_fp4_guided": "fp4", "builtin": "fp4"}


def floor_tok_s(row: dict, bandwidth: float) -> float:
    """Decode tok/s at the bandwidth floor for a decode row (its engine's formats, context at the
    middle of its decode tokens): bench/rollout_throughput.py's `floor_seconds`."""
    from bench.rollout_throughput import floor_seconds
    from megatron_trace.model_config import PRESETS

    cfg = PRESETS["qwen3-30b-a3b"].replace(num_layers=row["layers"])
    context = row["context"] + row["new"] // 2
    return row["batch"] / floor_seconds(cfg, row["batch"], context, FLOOR_FORMAT[row["engine"]], bandwidth)


def report(path: Path, bandwidth: float) -> str:
    """Markdown: per engine (in the order first seen) its start, whole generate, and per decode
    context the prefill, decode tok/s beside its bandwidth floor (bench/rollout_throughput.py's
    `floor_seconds`: weights, reached experts, head and KV cache in the engine's formats), and
    the whole generate of that phase."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    contexts = sorted({r["context"] for r in rows if r["phase"] == "decode"})
    cases = list(dict.fromkeys((r["prompt"], r["new"]) for r in rows if r["phase"] == "generate"))
    head = ["engine", "start s"] + [f"generate {p} + {n}, tok/s" for p, n in cases]
    for c in contexts:
        head += [f"prefill {c} s", f"decode at {c}, tok/s", f"streamed decode at {c}, tok/s", f"floor at {c}, tok/s",
                 f"decode / floor at {c}", f"generate {c} + N, tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in engines:
        mine = [r for r in rows if r["engine"] == e]
        cells = [NAMES.get(e, e), str(mine[0].get("start_s", ""))]
        for p_len, n in cases:
            g = [r for r in mine if r["phase"] == "generate" and (r["prompt"], r["new"]) == (p_len, n)]
            cells.append(f"{g[-1]['tok_s']:.0f}" if g else "-")
        for c in contexts:
            d = [r for r in mine if r["phase"] == "decode" and r["context"] == c]
            if not d:
                cells += ["-"] * 6
                continue
            d = d[-1]
            floor = floor_tok_s(d, bandwidth)
            tok = d["tok_s"]
            streamed = f"{d['streamed_tok_s']:.0f}" if d.get("streamed_tok_s") else "-"
            cells += [f"{d['prefill_s']:.2f}", "-" if tok is None else f"{tok:.0f}", streamed, f"{floor:.0f}",
                      "-" if tok is None else f"{tok / floor:.2f}", f"{d['generate_tok_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for e in engines:  # below the batch's need, the long phases run in waves of smaller batches
        r = next((r for r in rows if r["engine"] == e and r.get("kv_tokens") is not None), None)
        if r is not None and r["kv_tokens"] < r["kv_tokens_needed"]:
            lines.append(f"\n{NAMES.get(e, e)}: its KV pool holds {r['kv_tokens']} tokens of the "
                         f"{r['kv_tokens_needed']} the batch needs; its longest phases ran in waves.")
    return "\n".join(lines)


def kernel_table(directory: Path, steps: int, top: int = 25) -> str:
    """Markdown: for each trace SGLang's profiler wrote under `directory` (*.trace.json.gz, one
    per stage), the GPU time per kernel over its `steps` forwards: calls and ms per forward,
    share of the stage's kernel time, largest first."""
    import gzip

    lines = []
    for trace in sorted(directory.glob("*.trace.json*")):
        opener = gzip.open if trace.suffix == ".gz" else open
        with opener(trace, "rt") as f:
            events = json.load(f)["traceEvents"]
        per: dict[str, list[float]] = {}
        for e in events:
            if e.get("cat") == "kernel":
                per.setdefault(e["name"], []).append(e.get("dur", 0.0))
        total = sum(sum(v) for v in per.values()) or 1.0
        lines += [f"### {trace.name}: {total / 1e3 / steps:.3f} ms of kernels per forward, "
                  f"{sum(len(v) for v in per.values()) / steps:.0f} kernels per forward", "",
                  "| kernel | calls per forward | ms per forward | share |", "|---|---|---|---|"]
        ranked = sorted(per.items(), key=lambda kv: -sum(kv[1]))
        for name, durs in ranked[:top]:
            lines.append(f"| {name[:90]} | {len(durs) / steps:.0f} | {sum(durs) / 1e3 / steps:.3f} | "
                         f"{sum(durs) / total:.1%} |")
        rest = ranked[top:]
        if rest:
            ms = sum(sum(d) for _, d in rest)
            lines.append(f"| ({len(rest)} other kernels) | {sum(len(d) for _, d in rest) / steps:.0f} | "
                         f"{ms / 1e3 / steps:.3f} | {ms / total:.1%} |")
        lines.append("")
    return "\n".join(lines) if lines else f"no trace under {directory}\n"


def plot(path: Path, bandwidth: float) -> Path:
    """PNG beside the JSON lines (same name): per decode context, each engine's decode tok/s as a
    bar with its bandwidth floor as a mark, and its whole generate of that phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    decode = [r for r in rows if r["phase"] == "decode"]
    contexts = sorted({r["context"] for r in decode})
    engines = list(dict.fromkeys(r["engine"] for r in decode))
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.5), squeeze=False)
    for ax, c in zip(axes[0], contexts, strict=True):
        for i, e in enumerate(engines):
            mine = [r for r in decode if r["engine"] == e and r["context"] == c]
            if not mine:
                continue
            r = mine[-1]
            floor = floor_tok_s(r, bandwidth)
            ax.bar(i - 0.2, r["tok_s"] or 0, 0.4, color="tab:blue", label="decode" if i == 0 else None)
            ax.bar(i + 0.2, r["generate_tok_s"], 0.4, color="tab:orange", label="whole generate" if i == 0 else None)
            ax.plot([i - 0.4, i + 0.4], [floor, floor], "k--", label="decode bandwidth floor" if i == 0 else None)
        ax.set_xticks(range(len(engines)), [NAMES.get(e, e).replace(" + ", " +\n") for e in engines], fontsize=7)
        ax.set(ylabel="tokens/s", title=f"batch {decode[0]['batch']}, context {c}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{decode[0]['gpu']}, {decode[0]['date']}, {decode[0]['layers']} layers of Qwen3-30B-A3B")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
