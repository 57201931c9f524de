"""FP4 quantizer self-check and throughput, on whatever device is present.

Self-check: the Triton kernels (on CUDA, or under TRITON_INTERPRET=1 on the CPU) against
the torch reference, bit for bit, for every format and mode.

Throughput: quantize and dequantize of bf16 tensors, as achieved bytes/s (bf16 read once,
codes and scales written once; the reverse for dequantize) over the device-copy bandwidth
measured in the same run, beside the torch reference and torchao's NVFP4 quantizer; and the
trainer's fake quantization (values and straight-through mask, RNE and guided) in one kernel
against the three-step chain it replaced (quantize, dequantize, `ste_mask`), which the
self-check also compares bit for bit.

    python bench/fp4_quantize.py                      # self-check + table for this device
    python bench/fp4_quantize.py --record             # also write bench/results/fp4_quantize_*.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the kernels' definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tqdm import tqdm  # noqa: E402

from trace_kernels.fp4 import (  # noqa: E402
    dequantize,
    fake_quantize_guided_ste,
    fake_quantize_ste,
    pack_bits,
    quantize,
    quantize_guided,
    unpack_codes,
)
from trace_kernels.fp4.api import ste_mask  # noqa: E402

CASES = [("nvfp4", "row"), ("nvfp4", "tensor"), ("mxfp4", None)]
RESULTS = Path(__file__).resolve().parent / "results"


def self_check(device: str) -> list[str]:
    """Triton vs torch reference on one tensor per case; returns failure descriptions."""
    shape = (2048, 4096) if device == "cuda" else (64, 512)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * torch.exp(0.8 * torch.randn(1, shape[1], generator=g))).bfloat16().to(device)
    failures = []
    for fmt, scale in CASES:
        for rounding in ("rne", "stochastic"):
            seed = 7 if rounding == "stochastic" else None
            a = quantize(x, fmt, scale, rounding, seed, backend="torch")
            b = quantize(x, fmt, scale, rounding, seed, backend="triton")
            same = torch.equal(a.codes, b.codes) and torch.equal(
                a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
            if a.global_scale is not None:
                same = same and torch.equal(a.global_scale, b.global_scale)
            da = dequantize(a, torch.bfloat16, backend="torch")
            db = dequantize(a, torch.bfloat16, backend="triton")
            same = same and torch.equal(da.view(torch.int16), db.view(torch.int16))
            if not same:
                failures.append(f"{fmt}/{scale}/{rounding}")
    return failures + fake_self_check(x)


def three_step_fake(x, guidance=None, backend="auto", **kw):
    """The fake quantization chain before the fused kernel: (values, STE mask)."""
    q = (quantize_guided(x, *guidance, backend=backend, check_finite=False) if guidance
         else quantize(x, backend=backend, check_finite=False, **kw))
    return dequantize(q, x.dtype, backend=backend), ste_mask(x, q)


def fake_guidance(x):
    q = quantize(x, scale="row")
    return q.global_scale, q.block_scales, pack_bits(unpack_codes(q.codes) & 1)


def fake_self_check(x) -> list[str]:
    """The one-pass fake quantization against the three-step chain on the Triton backend: the
    values' bits and the mask, dynamic and clipping global scales, RNE and guided."""
    amax = x.float().abs().amax(-1, keepdim=True)
    cases = {"row": dict(scale="row"), "row/given": dict(scale="row", global_amax=amax / 3),
             "tensor": dict(scale="tensor"), "tensor/given": dict(global_amax=amax.max() / 3)}
    failures = []
    for name, kw in cases.items():
        kw = dict(kw, backend="triton")
        pairs = [(fake_quantize_ste(x, check_finite=False, **kw), three_step_fake(x, **kw))]
        if name == "row":
            guidance = fake_guidance(x)
            x_t = (x.float() * 1.2).bfloat16()
            pairs.append((fake_quantize_guided_ste(x_t, *guidance, backend="triton", check_finite=False),
                          three_step_fake(x_t, guidance, backend="triton")))
        for i, ((a, ma), (b, mb)) in enumerate(pairs):
            if not (torch.equal(a.view(torch.int16), b.view(torch.int16)) and torch.equal(ma, mb)):
                failures.append(f"fake/{name}{'/guided' if i else ''}")
    return failures


def time_fn(fn, device: str) -> float:
    """Median seconds per call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30 if device == "cuda" else 1 << 26
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * n / time_fn(lambda: dst.copy_(src), device)


def torchao_quantizer():
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
    except Exception:  # noqa: BLE001 - optional comparison; any import failure means "not available"
        return None

    def run(x):
        return nvfp4_quantize(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))

    return run


def quantized_bytes(m: int, k: int, fmt: str, scale: str | None) -> int:
    bs = 16 if fmt == "nvfp4" else 32
    g = {"row": 4 * m, "tensor": 4}.get(scale, 0)
    return m * k // 2 + m * k // bs + g


def run(sizes: list[tuple[int, int]], device: str) -> tuple[float, list[dict]]:
    bw = copy_bandwidth(device)
    ao = torchao_quantizer()
    rows = []
    jobs = [(m, k, fmt, scale) for m, k in sizes for fmt, scale in CASES]
    for m, k, fmt, scale in tqdm(jobs, desc="fp4 bench", file=sys.stderr):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        qbytes = quantized_bytes(m, k, fmt, scale)
        q_bytes, dq_bytes = 2 * m * k + qbytes, qbytes + 2 * m * k
        row = {"shape": f"{m}x{k}", "fmt": fmt, "scale": scale or "-"}
        impls = {"torch_ref": "torch"}
        if device == "cuda":
            impls["triton"] = "triton"
        for name, backend in impls.items():
            t = time_fn(lambda: quantize(x, fmt, scale, backend=backend, check_finite=False), device)
            row[f"quantize_{name}_us"] = t * 1e6
            row[f"quantize_{name}_frac"] = q_bytes / t / bw
            if backend == "triton":  # the same call with its NaN/Inf check (one host sync)
                t = time_fn(lambda: quantize(x, fmt, scale, backend=backend), device)
                row["quantize_triton_checked_us"] = t * 1e6
                row["quantize_triton_checked_frac"] = q_bytes / t / bw
            q = quantize(x, fmt, scale, backend=backend)
            t = time_fn(lambda: dequantize(q, torch.bfloat16, backend=backend), device)
            row[f"dequantize_{name}_us"] = t * 1e6
            row[f"dequantize_{name}_frac"] = dq_bytes / t / bw
        if fmt == "nvfp4" and scale == "row" and "triton" in impls:  # guided rounding beside plain
            q = quantize(x, fmt, scale)
            args = (q.global_scale, q.block_scales, pack_bits(unpack_codes(q.codes) & 1))
            t = time_fn(lambda: quantize_guided(x, *args, check_finite=False), device)
            row["guided_triton_us"] = t * 1e6
            row["guided_over_plain"] = t * 1e6 / row["quantize_triton_us"]
        if fmt == "nvfp4" and "triton" in impls:
            time_fake(row, x, scale, device)
        if ao is not None and fmt == "nvfp4" and scale == "tensor":
            t = time_fn(lambda: ao(x), device)
            row["quantize_torchao_us"] = t * 1e6
            row["quantize_torchao_frac"] = q_bytes / t / bw
        rows.append(row)
    return bw, rows


def time_fake(row: dict, x, scale: str, device: str) -> None:
    """Fake quantization (amax in the kernel for rows, `amax` first for the tensor): the three-step
    chain, the fused kernel with the mask and without; guided beside them for rows."""
    row["fake_3step_us"] = time_fn(lambda: three_step_fake(x, scale=scale), device) * 1e6
    row["fake_fused_us"] = time_fn(lambda: fake_quantize_ste(x, scale=scale, check_finite=False), device) * 1e6
    row["fake_nomask_us"] = time_fn(
        lambda: fake_quantize_ste(x, scale=scale, check_finite=False, with_mask=False), device) * 1e6
    row["fake_speedup"] = row["fake_3step_us"] / row["fake_fused_us"]
    if scale == "row":
        guidance = fake_guidance(x)
        row["fake_guided_3step_us"] = time_fn(lambda: three_step_fake(x, guidance), device) * 1e6
        row["fake_guided_fused_us"] = time_fn(
            lambda: fake_quantize_guided_ste(x, *guidance, check_finite=False), device) * 1e6


def table(rows: list[dict]) -> str:
    cols = ["shape", "fmt", "scale"]
    if any("guided_triton_us" in r for r in rows):
        cols += ["guided_triton_us", "guided_over_plain"]
    for key in ("quantize_triton", "quantize_triton_checked", "quantize_torch_ref", "quantize_torchao",
                "dequantize_triton", "dequantize_torch_ref"):
        if any(f"{key}_us" in r for r in rows):
            cols += [f"{key}_us", f"{key}_frac"]
    cols += [c for c in ("fake_3step_us", "fake_fused_us", "fake_nomask_us", "fake_speedup", "fake_guided_3step_us",
                         "fake_guided_fused_us") if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            precise = (c.endswith("_frac") or c.endswith("_over_plain") or c.endswith("_speedup")) and v != ""
            cells.append(f"{v:.3f}" if precise else f"{v:.1f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma list of MxK (default: by device)")
    ap.add_argument("--record", action="store_true", help="write the table under bench/results/")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = (torch.cuda.get_device_name() if device == "cuda"
            else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    default = "1024x1024,4096x4096,8192x8192" if device == "cuda" else "256x1024,1024x1024,2048x2048"
    sizes = [tuple(int(v) for v in s.split("x")) for s in (args.sizes or default).split(",")]

    failures = self_check(device)
    print(f"self-check on {name}: "
          + ("PASS (Triton == torch reference, bit for bit)" if not failures else f"FAIL {failures}"))
    bw, rows = run(sizes, device)
    date = datetime.date.today().isoformat()
    header = (f"# FP4 quantize / dequantize throughput\n\n{date}, {name}, torch {torch.__version__}. "
              f"Measured copy bandwidth (read + write): {bw / 1e12:.3f} TB/s. `_frac` = achieved bytes/s "
              f"over it (bf16 in, packed codes + scales out, counted once). Quantize columns time "
              f"`check_finite=False`; `_checked` adds the NaN/Inf check (a host sync). Tensor-scaled "
              f"NVFP4 includes its amax pass. `fake_*`: bf16 values and bool STE mask, the three-step "
              f"chain (quantize, dequantize, ste_mask) against the fused kernel (`nomask`: values only); "
              f"`fake_speedup` = 3step / fused.\n\n"
              f"Command: `python bench/fp4_quantize.py --record{' --sizes ' + args.sizes if args.sizes else ''}`\n")
    text = header + "\n" + table(rows) + "\n"
    print(text)
    if args.record:
        RESULTS.mkdir(parents=True, exist_ok=True)
        tag = f"fp4_quantize_{date}_{'h200' if 'H200' in name else device}"
        (RESULTS / f"{tag}.md").write_text(text)
        (RESULTS / f"{tag}.json").write_text(json.dumps(
            {"date": date, "device": name, "copy_bytes_per_s": bw, "rows": rows}, indent=1))
        print(f"wrote {RESULTS / tag}.md/.json")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
