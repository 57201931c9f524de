"""SGLang running TRACE's FP4 policy against the trainer and the built-in engine, on the CPU.

    python bench/sglang_parity.py [--model qwen3|deepseek-v3] [--out bench/results]

On the tiny Qwen3-MoE with experts of 64, or the tiny DeepSeek-V3 (MLA with a q latent, YaRN, a
dense layer, a shared expert; widths SGLang's CPU TP2 does not pad), seeded random weights: SGLang
FP4 engines (TP1, TP2)
generate with dense guidance on every layer; the Megatron trainer scores their samples without
and with the guidance (k3_kl and the other mismatch metrics, flip rates); the built-in engine
scores the same tokens (SGLang BF16 and FP4 against it); engine start and generate times.
Writes sglang_parity_<date>_cpu.{md,json} (deepseek-v3: sglang_parity_deepseek-v3_<date>_cpu).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("k3_kl", "train_rollout_logprob_abs_diff", "probs_diff_max")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--model", choices=("qwen3", "deepseek-v3"), default="qwen3")
    args = ap.parse_args()
    import sys

    sys.path.insert(0, str(ROOT))
    from megatron_trace.megatron.spawn import spawn
    from megatron_trace.rl.metrics import mismatch_metrics
    from sglang_rollout.engine import EngineConfig as BuiltinConfig
    from sglang_rollout.engine import TraceEngine
    from sglang_rollout.sglang import EngineConfig, SGLangEngine
    from tests.sglang_rollout.sglang import test_deepseek_sglang as ds
    from tests.sglang_rollout.sglang import test_sglang as t
    from tests.support import scenarios as sc

    model_cfg = t.CFG if args.model == "qwen3" else ds.CONFIGS["tp2"]
    sd = sc.random_full_state_dict(model_cfg, seed=21)
    prompts = {r.group_id: r.prompt_ids for r in t.REQUESTS}
    rows = {}
    for name, cfg in (("fp4 TP1", EngineConfig(precision="fp4", guide="all")),
                      ("fp4 TP2", EngineConfig(precision="fp4", guide="all", tp_size=2)),
                      ("bf16 TP1", EngineConfig(precision="bf16"))):
        t0 = time.perf_counter()
        engine = SGLangEngine(model_cfg, cfg)
        start = time.perf_counter() - t0
        engine.update_weights(sd, 0)
        t0 = time.perf_counter()
        out = engine.generate(t.REQUESTS, t.SAMPLING)
        row = {"engine_start_s": start, "generate_s": time.perf_counter() - t0,
               "tokens": sum(len(s.tokens) for s in out.samples)}
        engine.shutdown()
        precision = cfg.precision.value
        builtin = TraceEngine(model_cfg, BuiltinConfig(precision=precision, block_size=4, num_blocks=128))
        builtin.update_weights(sd, 0)
        scored = [builtin.score(list(t.REQUESTS[int(s.group_id[1])].prompt_ids) + s.tokens)[s.prompt_len - 1:]
                  for s in out.samples]
        engine_lp = [s.logprobs for s in out.samples]
        row["vs built-in engine"] = {k: mismatch_metrics(scored, engine_lp)[k] for k in KEYS}
        if precision == "fp4":
            got = spawn(sc.run_rollout_replay, {}, cfg=model_cfg, sd=sd, prompts=prompts, samples=out.samples,
                        guidance=out.guidance, grouped_gemm=args.model == "qwen3")[0]
            for mode in ("fp4-rne", "fp4-guided"):
                lp, rates = got[mode]
                row[f"trainer {mode}"] = {k: mismatch_metrics(lp, engine_lp)[k] for k in KEYS} | {
                    k: v for k, v in rates.items() if not isinstance(v, dict)}
            row["guidance_bytes_per_token"] = out.guidance.nbytes / out.guidance.num_tokens
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    date = datetime.date.today().isoformat()
    tag = "" if args.model == "qwen3" else f"{args.model}_"
    stem = Path(args.out) / f"sglang_parity_{tag}{date}_cpu"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"# SGLang running TRACE's FP4 policy, on the CPU — {date} ({os.cpu_count()} cores)", "",
             f"`python bench/sglang_parity.py --model {args.model}`: sglang 0.5.17, "
             + ("the tiny Qwen3-MoE with experts of 64" if args.model == "qwen3" else
                "the tiny DeepSeek-V3 (MLA + YaRN, 1 dense + 2 MoE layers, 8 experts of 64 + 1 shared)")
             + ", seeded random weights; 5 samples of 12 tokens (seed 4); dense guidance on every layer.", "",
             "| engine | compared with | k3_kl | logprob abs diff | probs diff max | flip rate | residual flip rate |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        for key in ("trainer fp4-rne", "trainer fp4-guided", "vs built-in engine"):
            if key in row:
                m = row[key]
                lines.append(f"| SGLang {name} | {key.replace('fp4-rne', 'fp4-rne (no guidance)')} | "
                             f"{m['k3_kl']:.3g} | {m['train_rollout_logprob_abs_diff']:.3g} | "
                             f"{m['probs_diff_max']:.3g} | {_fmt(m.get('flip_rate'))} | "
                             f"{_fmt(m.get('residual_flip_rate'))} |")
    lines += ["", "| engine | start s | generate s | tokens |", "|---|---|---|---|"]
    lines += [f"| SGLang {n} | {r['engine_start_s']:.1f} | {r['generate_s']:.2f} | {r['tokens']} |"
              for n, r in rows.items()]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.md")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    main()
