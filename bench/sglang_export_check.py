"""SGLang's own loaders on TRACE's FP4 exports (GPU: run through bench/gpu_sglang.sh's `export` step).

    bash .sglrun/run.sh bench/sglang_export_check.py --out $OUT/sglang_export.json

A random Qwen3-MoE of the `small` preset's shape (hidden 512, 16 experts of 256: widths SGLang's
Marlin kernels take) saved as an HF checkpoint, converted to Megatron and exported by
`trace-export-fp4` in both formats. Each export is loaded by `sglang.Engine` itself:

- ModelOpt NVFP4 through SGLang's `modelopt_fp4` method. On Hopper (no FP4 tensor cores) SGLang
  runs it weight-only through Marlin (`fp4_gemm_runner_backend="marlin"`, Marlin MoE): its prompt
  log-probabilities are compared with SGLang serving a BF16 checkpoint that holds our dequantized
  weights (W4A16 on the same weights: the same model up to GEMM order), with transformers' own
  Qwen3-MoE on those weights (an independent reference; SGLang BF16 against it gives the noise
  floor of two BF16 implementations), and with the original BF16 weights (the quantization's own
  effect, for scale). SGLang builds its Marlin kernels with nvcc at first use: carry them prebuilt
  (bench/sglang_h200/prebuild_jit.py, TVM_FFI_CACHE_DIR);
- compressed-tensors NVFP4 through SGLang's `compressed-tensors` method: SGLang 0.5.17 asks for
  compute capability 10.0 (Blackwell) for its W4A4 NVFP4 schemes, so on an H200 the load is
  expected to be refused; the refusal is recorded;
- the ModelOpt export through `trace_fp4` (TRACE's W4A4 on the exported bytes) against the
  built-in engine on the same export (tests/sglang_rollout/sglang/test_serve_export.py is the CPU
  version).

Writes a JSON summary (k3_kl and the largest log-prob difference per comparison, errors).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKS = ("bf16", "dequantized", "hf-dequantized", "marlin-kv", "marlin", "compressed-tensors", "trace")
ENGINE_TIMEOUT_S = 600  # --engine-timeout
LOG_DIR: Path | None = None  # each engine's stderr is written beside --out
ENGINE_LOG_LEVEL = "error"  # --log-level
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8]]


def save_hf(path: Path) -> None:
    """A random BF16 Qwen3-MoE (the `small` preset's shape, 2 layers) written by transformers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_trace.model_config import PRESETS

    c = PRESETS["small"]
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=c.hidden_size, intermediate_size=1024,
                         moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=2,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, num_experts=c.num_experts, num_experts_per_tok=c.top_k,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=c.rope_theta,
                         max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.05)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def dequantized_copy(export: Path, out: Path) -> None:
    """An HF BF16 checkpoint holding the ModelOpt export's weights dequantized (every other tensor as stored)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_trace.checkpoint.fp4_export import _fp4_parts
    from megatron_trace.checkpoint.safetensors_io import SafetensorsDir
    from trace_kernels.fp4 import Format, QTensor, dequantize

    ckpt = SafetensorsDir(export)
    tensors = {}
    for file in sorted(export.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            module = name.removesuffix(".weight")
            if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")):
                continue
            if f"{module}.weight_scale" in ckpt:
                codes, scales, g = _fp4_parts(ckpt, module, "modelopt")
                shape = torch.Size((codes.shape[0], codes.shape[1] * 2))
                tensors[name] = dequantize(QTensor(codes, scales, g, Format.NVFP4, shape), torch.bfloat16).contiguous()
            else:
                tensors[name] = ckpt.get(name).contiguous()
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((export / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def prompt_logprobs(model_path: Path, **args) -> list[torch.Tensor]:
    """Each prompt's token log-probs (positions 1..) under sglang.Engine serving model_path, in a
    process of its own: a scheduler that fails to start makes SGLang send SIGQUIT to the process
    that started it, which would end this check before it reports."""
    log = LOG_DIR / f"engine_{model_path.name}_{args.get('quantization', 'bf16')}.log" if LOG_DIR else None
    spec = json.dumps({"path": str(model_path), "args": args, "log_level": ENGINE_LOG_LEVEL})
    # a session of its own: on a timeout SGLang's scheduler processes go with it, not only the host process
    proc = subprocess.Popen([sys.executable, __file__, "--one", spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # with PYTHONFAULTHANDLER each process prints where it waits
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        if log:
            log.write_text(stderr)
        raise RuntimeError(f"no result after {ENGINE_TIMEOUT_S:.0f} s; its log ends: {stderr[-800:]}") from None
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if log:
        log.write_text(proc.stderr)
    if proc.returncode:
        lines = [x for x in proc.stderr.splitlines() if "Error" in x or "error" in x]
        raise RuntimeError(f"exit {proc.returncode}: {' | '.join(lines[-3:]) or proc.stderr[-800:]}")
    return [torch.tensor(row) for row in json.loads(proc.stdout.strip().splitlines()[-1])]


def _one(spec: str) -> None:
    """--one: prompt_logprobs of one engine in this process, printed as JSON."""
    import sglang

    spec = json.loads(spec)
    model_path, args = Path(spec["path"]), spec["args"]

    engine = sglang.Engine(model_path=str(model_path), skip_tokenizer_init=True, log_level=spec["log_level"],
                           disable_cuda_graph=True, mem_fraction_static=0.3, random_seed=0, **args)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               return_logprob=True, logprob_start_len=0)
    finally:
        engine.shutdown()
    print(json.dumps([[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]))


def hf_prompt_logprobs(model_path: Path) -> list[torch.Tensor]:
    """Each prompt's token log-probs (positions 1..) under transformers' own Qwen3-MoE in BF16 on the GPU:
    an independent reference that needs no SGLang kernel built."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].cpu())
    del model
    torch.cuda.empty_cache()
    return out


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    from megatron_trace.rl.metrics import mismatch_metrics

    return {"k3_kl": mismatch_metrics(a, b)["k3_kl"],
            "max_abs_logprob_diff": max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        return _one(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"a comma list of {', '.join(CHECKS)}")
    ap.add_argument("--engine-timeout", type=float, default=600, help="seconds one engine may take")
    ap.add_argument("--log-level", default="error", help="SGLang's log level in each engine")
    args = ap.parse_args()
    global ENGINE_TIMEOUT_S, LOG_DIR, ENGINE_LOG_LEVEL
    ENGINE_TIMEOUT_S, LOG_DIR, ENGINE_LOG_LEVEL = args.engine_timeout, args.out.parent, args.log_level
    checks = args.checks.split(",")
    if unknown := set(checks) - set(CHECKS):
        ap.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    from megatron_trace.checkpoint.cli import export_main
    from megatron_trace.checkpoint.convert import hf_to_megatron

    work = Path(tempfile.mkdtemp())
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "runs": {}}
    save_hf(work / "hf")
    hf_to_megatron(work / "hf", work / "megatron")
    for fmt, kv in (("modelopt", "fp4"), ("modelopt", "none"), ("compressed-tensors", "fp4")):
        export_main(["--megatron", str(work / "megatron"), "--out", str(work / f"{fmt}-kv-{kv}"), "--format", fmt,
                     "--kv-cache", kv, "--calib-random", "2", "--calib-len", "32"])
    dequantized_copy(work / "modelopt-kv-none", work / "dequantized")

    def attempt(name, fn, check):
        if check not in checks:
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
            result["runs"][name] = {"ok": True, "s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - every outcome is recorded, the next check still runs
            result["runs"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                                    "trace": traceback.format_exc()[-3000:]}
            value = None
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # kept if a later check is cut off
        return value

    bf16 = attempt("sglang bf16, original weights", lambda: prompt_logprobs(work / "hf", attention_backend="triton"),
                   "bf16")
    deq = attempt("sglang bf16, dequantized FP4 weights",
                  lambda: prompt_logprobs(work / "dequantized", attention_backend="triton"), "dequantized")
    hf_deq = attempt("transformers bf16, dequantized FP4 weights", lambda: hf_prompt_logprobs(work / "dequantized"),
                     "hf-dequantized")
    if hf_deq is not None and deq is not None:
        result["SGLang BF16 vs transformers BF16, dequantized weights"] = compare(deq, hf_deq)
    marlin = dict(quantization="modelopt_fp4", fp4_gemm_runner_backend="marlin", moe_runner_backend="marlin",
                  attention_backend="triton")
    # as exported for TRACE's engines (kv_cache_quant_algo NVFP4), then without the KV-cache field
    w4a16_kv = attempt("sglang modelopt_fp4 (Marlin W4A16), kv_cache_quant_algo NVFP4",
                       lambda: prompt_logprobs(work / "modelopt-kv-fp4", **marlin), "marlin-kv")
    w4a16 = attempt("sglang modelopt_fp4 (Marlin W4A16), no KV-cache field",
                    lambda: prompt_logprobs(work / "modelopt-kv-none", **marlin), "marlin")
    for name, ref in (("SGLang BF16", deq), ("transformers BF16", hf_deq)):
        if ref is not None and w4a16 is not None:
            result[f"modelopt W4A16 vs {name} dequantized"] = compare(w4a16, ref)
        if ref is not None and w4a16_kv is not None:
            result[f"modelopt W4A16 (kv_cache_quant_algo NVFP4) vs {name} dequantized"] = compare(w4a16_kv, ref)
    if bf16 is not None and deq is not None:
        result["BF16 dequantized vs BF16 original"] = compare(deq, bf16)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    attempt("sglang compressed-tensors NVFP4", lambda: prompt_logprobs(
        work / "compressed-tensors-kv-fp4", quantization="compressed-tensors", attention_backend="triton"),
            "compressed-tensors")
    if "trace" in checks:
        result["trace_fp4 vs built-in engine"] = attempt("trace_fp4 on the export", lambda: trace_fp4_check(work),
                                                         "trace")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    for name, r in result["runs"].items():
        print(f"{name}: {'ok' if r['ok'] else r['error'][:400]}")
    shutil.rmtree(work, ignore_errors=True)


def trace_fp4_check(work: Path) -> dict:
    """The ModelOpt export through trace_fp4 against the built-in engine on the same bytes (greedy)."""
    from megatron_trace.checkpoint.fp4_export import load_fp4_export
    from megatron_trace.rl.evaluate import eval_engine
    from megatron_trace.rollout import GroupRequest, SamplingParams

    cfg, state = load_fp4_export(work / "modelopt-kv-fp4")
    requests = [GroupRequest(f"p{i}", tuple(p), n=1) for i, p in enumerate(PROMPTS)]
    out = {}
    for engine in ("sglang", "builtin"):
        backend = eval_engine(cfg, "fp4", len(PROMPTS), 16, 16, engine=engine)
        try:
            backend.update_weights(state, 0)
            out[engine] = backend.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=16, seed=0))
        finally:
            getattr(backend, "shutdown", lambda: None)()
    same = [a.tokens == b.tokens for a, b in zip(out["sglang"].samples, out["builtin"].samples, strict=True)]
    return {"same_tokens": all(same), **compare([s.logprobs for s in out["sglang"].samples],
                                                [s.logprobs for s in out["builtin"].samples])}


if __name__ == "__main__":
    main()
