"""Exporting a checkpoint several times larger than a memory cap stays under the cap (peak RSS
above the post-import baseline of a fresh process, measured by bench/export_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CAP = 48 << 20


def test_fp4_export_streams_under_a_memory_cap(tmp_path):
    out = tmp_path / "mem.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "export_memory.py"), "--layers", "8", "--experts", "64",
                    "--hidden", "256", "--shard-mb", "4", "--json", str(out)], check=True, cwd=ROOT)
    row = json.loads(out.read_text())
    assert row["checkpoint_bytes"] > 4 * CAP  # ~200 MiB of BF16 tensors
    assert row["peak_extra_rss_bytes"] < CAP, row
