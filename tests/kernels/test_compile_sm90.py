"""The fused sampler's Triton kernels compile for an H100 (sm_90) on the CPU, as the GPU machine's
Triton 3.6 compiles them, with no register spills and room for 4 programs of the split kernel an
SM (its tuning, kernels/sampling.py): a check that runs in CI, which has no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sampling_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.support.compile_sm90"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = {r["name"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert set(reports) == {"sample_split scale=False", "sample_split scale=True", "sample_join scale=False",
                            "sample_join scale=True", "gumbel_argmax"}
    for name, r in reports.items():
        assert r["cubin_bytes"] > 0 and r["spill_bytes"] == 0, (name, r)
    for scale in (False, True):
        r = reports[f"sample_split scale={scale}"]
        assert 4 * r["registers"] * 32 * r["warps"] <= 65536, r  # an SM's register file holds 4 programs
