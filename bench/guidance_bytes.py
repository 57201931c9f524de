"""Guidance bytes against flips on activations with realistic drift (docs/design.md 4.4).

Engine and trainer activations are the same BF16 matmul reduced in two orders (the trainer
adds two partial products), which leaves ulp-level drift like two kernels do. For each
coding: bits per element shipped, the flip rate of the trainer's own RNE codes against the
engine's, and the residual flip rate after guidance.

    python bench/guidance_bytes.py --record
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_trace.guidance import (
    Coding,
    calibrate_tau,
    capture,
    code_flips,
    guided_inputs,
)
from trace_kernels.fp4 import quantize, quantize_guided, unpack_codes

RESULTS = Path(__file__).resolve().parent / "results"


def activations(rows: int, k_in: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, k_in, generator=g) * torch.exp(0.8 * torch.randn(1, k_in, generator=g))).bfloat16()
    w = (torch.randn(k_in, cols, generator=g) * torch.exp(0.5 * torch.randn(1, cols, generator=g))
         / k_in**0.5).bfloat16()
    engine = (a.float() @ w.float()).bfloat16()
    h = k_in // 3
    trainer = ((a[:, :h].float() @ w[:h].float()).bfloat16().float() + (a[:, h:].float() @ w[h:].float())).bfloat16()
    return engine, trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    x_e, x_t = activations(args.rows, 1024, args.cols, seed=0)
    q_e = quantize(x_e, scale="row")
    engine_codes = unpack_codes(q_e.codes)
    n = x_e.numel()
    plain_flips = code_flips(engine_codes, unpack_codes(quantize(x_t, scale="row").codes)).float().mean().item()
    meta = dict(model_id="bench", layer=0, site="fc1", sample_id="0", weight_version=0, policy="all")
    rows = [{"coding": "full codes + scales + g", "bits_per_element": (n * 4 + n / 16 * 8 + args.rows * 32) / n,
             "flip_rate": plain_flips, "residual_flip_rate": 0.0}]
    configs = ([("dense", None, None, None)]
               + [("sparse", t, "lsb", None) for t in (0.5, 1, 1.5, 2, 3, 4)]
               + [("sparse", t, "near", st) for t, st in [(1, 0.5), (1, 1), (2, 1), (2, 2), (4, 2)]])
    for coding, tau, scale_coding, scale_tau in tqdm(configs, desc="codings"):
        kw = {} if coding == "dense" else {"tau": tau, "scale_coding": scale_coding}
        if scale_tau is not None:
            kw["scale_tau"] = scale_tau
        rec = capture(x_e, q_e, coding=Coding(coding), **meta, **kw)
        guided = unpack_codes(quantize_guided(x_t, *guided_inputs(rec, x_t)).codes)
        residual = code_flips(engine_codes, guided).float().mean().item()
        name = ("dense mantissa + scales + g" if coding == "dense" else
                f"sparse tau={tau}, scale LSBs" if scale_coding == "lsb" else
                f"sparse tau={tau}, scales near boundary (scale_tau={scale_tau})")
        rows.append({"coding": name, "bits_per_element": rec.bits_per_element, "flip_rate": plain_flips,
                     "residual_flip_rate": residual,
                     "kept_elements": rec.header.n_elems / n if coding == "sparse" else 1.0,
                     "kept_scales": rec.header.n_scales / (n / 16) if coding == "sparse" else 1.0})
    cal = calibrate_tau(x_e, x_t, q_e, target_escape_rate=1e-4)
    date = datetime.date.today().isoformat()
    lines = [f"# Guidance bytes vs flips\n\n{date}, CPU (numerics only; no timing). "
             f"Activations {args.rows}x{args.cols} BF16 from a 1024-deep matmul; "
             f"trainer = the same matmul summed in two parts. "
             f"Flip rate of the trainer's own RNE codes (own scales): {plain_flips:.4%}. "
             f"calibrate_tau(target 1e-4) -> tau {cal['tau']} (keeps {cal['kept_rate']:.2%}).\n",
             "Command: `python bench/guidance_bytes.py --record`\n",
             "| coding | bits/element | kept elements | kept scales | flip rate (no guidance) | residual flip rate |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['coding']} | {r['bits_per_element']:.3f} | {r.get('kept_elements', 1.0):.2%} | "
                     f"{r.get('kept_scales', 1.0):.2%} | {r['flip_rate']:.2e} | {r['residual_flip_rate']:.2e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"guidance_bytes_{date}.md").write_text(text)
        (RESULTS / f"guidance_bytes_{date}.json").write_text(
            json.dumps({"date": date, "calibration": cal, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
