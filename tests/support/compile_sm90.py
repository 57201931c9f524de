"""Compile the fused sampler's Triton kernels for an H100 (sm_90) on a machine without a GPU, as
the GPU machine's Triton would, and print what ptxas reports for each as JSON lines.

    python -m tests.support.compile_sm90

Run without TRITON_INTERPRET (under it `triton.jit` gives interpreter objects that cannot be
compiled): tests/kernels/test_compile_sm90.py starts it in a subprocess. Triton's wheel brings
its own ptxas, so no CUDA toolkit is needed. Reports: name, registers a thread, spill bytes,
warps, and the cubin's size.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trace_kernels import sampling

TARGET = GPUTarget("cuda", 90, 32)
VOCAB = 151936  # Qwen3's


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers a thread, spill store + load bytes) that ptxas -v gives for one kernel's PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return regs, spills


def kernels() -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, signature, constexprs, warps) as `sample_tempered` and `gumbel_argmax` launch
    them at Qwen3's vocabulary and a decode batch of 64."""
    split = {"logits_ptr": "*bf16", "keys_ptr": "*i64", "steps_ptr": "*i64", "part_ptr": "*fp32", "t": "fp32",
             "splits": "i32", "V": "constexpr", "CHUNK": "constexpr", "BLOCK": "constexpr", "SCALE": "constexpr"}
    join = {"logits_ptr": "*bf16", "part_ptr": "*fp32", "tokens_ptr": "*i64", "logps_ptr": "*fp32", "t": "fp32",
            "splits": "i32", "V": "constexpr", "SPLITS": "constexpr", "SCALE": "constexpr"}
    gumbel = {"x_ptr": "*fp32", "keys_ptr": "*i64", "steps_ptr": "*i64", "out_ptr": "*i64", "V": "constexpr",
              "BLOCK": "constexpr"}
    block = sampling.SPLIT_BLOCK
    chunk = 5 * block
    out = []
    for scale in (False, True):
        out.append((f"sample_split scale={scale}", sampling._sample_split_kernel, split,
                    {"V": VOCAB, "CHUNK": chunk, "BLOCK": block, "SCALE": scale}, sampling.SPLIT_WARPS))
        out.append((f"sample_join scale={scale}", sampling._sample_join_kernel, join,
                    {"V": VOCAB, "SPLITS": 16, "SCALE": scale}, 4))
    out.append(("gumbel_argmax", sampling._gumbel_argmax_kernel, gumbel, {"V": VOCAB, "BLOCK": sampling.BLOCK_V}, 4))
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_sm90: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    for name, fn, signature, constexprs, warps in kernels():
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                                  options={"num_warps": warps})
        regs, spills = ptxas_report(compiled.asm["ptx"])
        print(json.dumps({"name": name, "registers": regs, "spill_bytes": spills, "warps": warps,
                          "cubin_bytes": len(compiled.asm["cubin"])}), flush=True)


if __name__ == "__main__":
    main()
