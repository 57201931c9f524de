"""Instruction mix of the FP4 decode kernels' main loop, compiled for Hopper on any machine.

Triton compiles for sm_90 without a GPU (its wheel carries ptxas and cuobjdump), so the effect
of a kernel change on the SASS can be read on the CPU before spending device time:

    python bench/sass_mix.py attention            # paged attention, Qwen3-30B-A3B shapes
    python bench/sass_mix.py grouped --opt num_warps=8

Prints registers, spills, the main loop's instruction count (the longest backward branch) and
its opcode histogram. Arguments are specialised as the launcher would (pointers and int32
arguments divisible by 16). It reads code, it does not time it: bench/decode_kernels.py does.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def kernel_cases():
    """name -> (jit function, {argument: type}, {constexpr: value}, launch options), at the
    shapes bench/decode_kernels.py times (Qwen3-30B-A3B, batch 64, 8k context)."""
    from trace_kernels.fp4 import linear, paged_attention

    attn = paged_attention.TILE
    gemm = linear.TILE
    return {
        "attention": (paged_attention._split_kernel,
                      dict(q_ptr="*bf16", kc_ptr="*u8", ks_ptr="*u8", kg_ptr="*fp32", vc_ptr="*u8", vs_ptr="*u8",
                           vg_ptr="*fp32", tables_ptr="*i32", lens_ptr="*i32", part_o_ptr="*fp32",
                           part_ml_ptr="*fp32", MAX_BLOCKS="i32", scale="fp32"),
                      dict(HQ=32, HKV=4, G=8, G_PAD=16, D=128, BLOCK_SIZE=16, BLOCK_T=attn["block_t"], MIN_CHUNK=256,
                           DOUBLINGS=0, SPLITS=32, IS_FP4=True, INTERPRET=False, SMALL=False),
                      dict(num_warps=attn["num_warps"])),
        "grouped": (linear._fp4_grouped_kernel,
                    dict(x_ptr="*bf16", codes_ptr="*u8", scales_ptr="*u8", g_ptr="*fp32", tiles_ptr="*i32",
                         y_ptr="*bf16", N="i32"),
                    dict(K=2048, BLOCK_M=16, BLOCK_N=gemm["block_n"], BLOCK_K=gemm["block_k"], INTERPRET=False),
                    dict(num_warps=gemm["num_warps"], enable_fp_fusion=False)),
        "dense": (linear._fp4_linear_kernel,
                  dict(x_ptr="*bf16", codes_ptr="*u8", scales_ptr="*u8", g_ptr="*fp32", y_ptr="*fp32", M="i32",
                       N="i32"),
                  dict(K=2048, K_SPLIT=512, BLOCK_M=16, BLOCK_N=gemm["block_n"], BLOCK_K=gemm["block_k"],
                       INTERPRET=False),
                  dict(num_warps=gemm["num_warps"], enable_fp_fusion=False)),
    }


def compile_sm90(fn, types: dict, constants: dict, options: dict):
    """Triton's CompiledKernel for compute capability 9.0, built on this machine."""
    names = list(fn.arg_names)
    signature = {**types, **{k: "constexpr" for k in constants}}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, t in types.items() if t.startswith("*") or t == "i32"}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode histogram (no modifiers) of the longest backward branch's body."""
    lines = re.findall(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", sass)
    best = (0, 0)
    for addr, text in lines:
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < int(addr, 16):
            best = max(best, (int(m.group(1), 16), int(addr, 16)), key=lambda s: s[1] - s[0])
    ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
           for addr, text in lines if best[0] <= int(addr, 16) <= best[1]]
    return len(ops), collections.Counter(ops)


def main() -> None:
    cases = kernel_cases()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=sorted(cases))
    ap.add_argument("--opt", action="append", default=[], metavar="NAME=INT",
                    help="override a launch option or constexpr (repeatable), e.g. num_warps=8, BLOCK_T=64")
    args = ap.parse_args()
    fn, types, constants, options = cases[args.kernel]
    for item in args.opt:
        name, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            raise SystemExit(f"--opt {item!r}: expected NAME=INT")
        (constants if name in constants else options)[name] = int(value)
    kernel = compile_sm90(fn, types, constants, options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    resources = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", usage))
    count, mix = loop_mix(sass)
    print(f"{args.kernel} {constants} {options}\n{resources}\nmain loop: {count} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common(24)))


if __name__ == "__main__":
    main()
