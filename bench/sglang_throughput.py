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
  generate  P:N   whole generate of P-token prompts and N new tokens: N * batch / seconds;
  decode    C     (after one unmeasured prefill of C-token prompts, which warms its kernels)
                  prompts of C tokens generating 1 token, then other prompts of C tokens
                  generating 1 + `--decode-tokens`: decode tok/s = batch * decode_tokens / (t2 - t1)
                  (the second call's whole generate is reported too).
One engine per process (`--engine`); JSON lines appended to `--out`.

    bash .sglrun/run.sh bench/sglang_throughput.py --engine trace_fp4 --out $OUT/sglang.jsonl  # GPU
"""

from __future__ import annotations

import argparse
import json
import os
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
    short = [n for n in lengths if n != new_tokens]
    if short:
        raise RuntimeError(f"requests ended early: {short[:4]} of {new_tokens} tokens")
    return seconds


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
    p.add_argument("--engine", choices=sorted(ENGINES), required=True)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--generate", default="128:128", help="P:N cases, comma-separated ('' for none)")
    p.add_argument("--decode", default="1024,8192", help="contexts, comma-separated ('' for none)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--attention", default="flashinfer", help="attention backend of the bf16 and fp8 engines")
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=1, help="SGLang's page_size (16: TRACE's CUDA split-K attention)")
    p.add_argument("--guided-layers", type=int, default=8, help="trace_fp4_guided: guidance of the last K layers")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="builtin: new tokens per forward (its prefill chunk; SGLang's own default is 8192 here)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
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
        print(json.dumps(record), flush=True)
        try:
            timed(engine, prompts(args.batch, 64, cfg.vocab_size, 1), 8)  # warm-up
            seed = 10
            for p_len, n in cases:
                seconds = timed(engine, prompts(args.batch, p_len, cfg.vocab_size, seed), n)
                seed += 1
                row = record | {"phase": "generate", "prompt": p_len, "new": n, "seconds": round(seconds, 3),
                                "tok_s": round(args.batch * n / seconds, 1)}
                print(json.dumps(row), flush=True)
                _append(args.out, row)
            for c in contexts:
                timed(engine, prompts(args.batch, c, cfg.vocab_size, seed + 100), 1)  # this prefill's kernels warm
                t1 = timed(engine, prompts(args.batch, c, cfg.vocab_size, seed), 1)
                t2 = timed(engine, prompts(args.batch, c, cfg.vocab_size, seed + 1), 1 + args.decode_tokens)
                seed += 2
                row = record | {"phase": "decode", "context": c, "new": args.decode_tokens, "prefill_s": round(t1, 3),
                                "generate_s": round(t2, 3),
                                "tok_s": round(args.batch * args.decode_tokens / (t2 - t1), 1) if t2 > t1 else None,
                                "generate_tok_s": round(args.batch * (1 + args.decode_tokens) / t2, 1)}
                print(json.dumps(row), flush=True)
                _append(args.out, row)
        finally:
            engine.shutdown()


def _append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
