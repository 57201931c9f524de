"""The FP4 decode kernels compiled for Hopper (sm_90) on the CPU by bench/sass_mix.py: no
register spills at the shipped launch shapes, and tensor-core MMAs in the main loop. A spill or
a loop that lost its MMAs is a regression the interpreter tests cannot see."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["attention", "grouped", "dense"])
def test_decode_kernel_compiles_for_hopper_without_spills(name):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_mix.py"), name], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"\bSTACK:0\b", out.stdout) and re.search(r"\bLOCAL:0\b", out.stdout), out.stdout
    count = int(re.search(r"main loop: (\d+) instructions", out.stdout).group(1))
    mix = {op: int(n) for op, n in re.findall(r"\b([A-Z][A-Z0-9]+) (\d+)\b", out.stdout.splitlines()[-1])}
    assert count > 100 and mix.get("HMMA", 0) + mix.get("HGMMA", 0) > 0, out.stdout
    assert mix.get("F2FP", 0) > 0 and mix.get("HMUL2", 0) > 0, out.stdout  # E4M3 -> f16x2, f16 scale products
