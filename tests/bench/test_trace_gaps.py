"""bench/trace_gaps.py on a small made-up trace: busy time against a count of busy microseconds,
and each idle gap laid to the right frame."""

import gzip
import json
from pathlib import Path

import pytest

from tests.support.bench_scripts import bench_module


@pytest.fixture(scope="module")
def tg():
    yield from bench_module("trace_gaps")


def _x(cat, name, ts, dur, corr=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    return event | ({"args": {"correlation": corr}} if corr else {})


KERNELS = [(20, 100), (60, 40), (510, 100), (700, 100), (800, 10)]  # (start, duration), two overlapping
LAUNCHES = [10, 15, 500, 520, 530]


def _trace(path: Path):
    events = [_x("python_function", "/site/megatron_trace/megatron/qat.py(10): quantize", 0, 1000),
              _x("python_function", "/site/torch/nn/module.py(3): _call_impl", 100, 800),
              _x("python_function", "/site/megatron/core/transformer/moe/experts.py(7): forward", 450, 100)]
    for i, ((ts, dur), at) in enumerate(zip(KERNELS, LAUNCHES, strict=True), start=1):
        events += [_x("cuda_runtime", "cudaLaunchKernel", at, 2, i), _x("kernel", f"k{i}", ts, dur, i)]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_time_and_gaps_are_laid_to_the_launching_frame(tg, tmp_path):
    _trace(tmp_path / "t.json.gz")
    g = tg.gaps(tmp_path / "t.json.gz", min_gap_us=20)
    busy_us = len({us for ts, dur in KERNELS for us in range(ts, ts + dur)})
    assert g.busy_us == pytest.approx(busy_us) and g.span_us == pytest.approx(810 - 20)
    # k3 was launched at 500, after k1 ended at 120: the host was late, inside qat.py's frame
    # (the innermost TRACE frame wins over Megatron's); k4 was launched at 520, before k3 ended
    # at 610: the GPU waited for something else; k5 follows k4 with no gap
    assert dict(g.idle_by_frame) == {"megatron/qat.py(10): quantize": pytest.approx(390),
                                     "waited, launched early: k4": pytest.approx(90)}
    assert g.runtime["cudaLaunchKernel"] == (5, pytest.approx(10))


def test_a_trace_without_kernels_is_refused_by_name(tg, tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}))
    with pytest.raises(SystemExit, match="no GPU kernels"):
        tg.gaps(path)
