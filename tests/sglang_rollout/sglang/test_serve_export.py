"""SGLang serves TRACE's final checkpoint: an FP4 export (`trace-export-fp4`) of an HF Qwen3-MoE
checkpoint, read back by `load_fp4_export` and served through `trace_fp4` with the exported
bytes as they are, gives the log-probabilities of the built-in engine serving the same export.
(SGLang's own ModelOpt loader runs the export weight-only on a Hopper GPU: bench/sglang_export_check.py.)"""

from __future__ import annotations

import torch

from megatron_trace.checkpoint.cli import export_main
from megatron_trace.checkpoint.convert import hf_to_megatron
from megatron_trace.checkpoint.fp4_export import load_fp4_export
from megatron_trace.model_config import fp4_site_of
from megatron_trace.rl.evaluate import eval_engine
from megatron_trace.rl.metrics import mismatch_metrics
from megatron_trace.rollout import GroupRequest, SamplingParams
from tests.support.hf_models import save_hf_tiny
from trace_kernels.fp4 import QTensor

REQUESTS = [GroupRequest("g0", (3, 1, 4, 1, 5), n=2), GroupRequest("g1", (2, 7, 1, 8), n=2)]


def test_an_fp4_export_served_by_sglang_gives_the_built_in_engines_log_probs(tmp_path):
    save_hf_tiny(tmp_path / "hf", seed=5)
    hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    export_main(["--megatron", str(tmp_path / "megatron"), "--out", str(tmp_path / "fp4"), "--format", "modelopt",
                 "--calib-random", "2", "--calib-len", "16"])
    cfg, state = load_fp4_export(tmp_path / "fp4")
    packed = {name for name, t in state.items() if isinstance(t, QTensor)}
    assert packed and packed == {name for name in state if fp4_site_of(name) is not None}  # served as exported
    out = {}
    for engine in ("sglang", "builtin"):
        backend = eval_engine(cfg, "fp4", 4, 8, 10, engine=engine)
        try:
            backend.update_weights(state, 0)
            out[engine] = backend.generate(REQUESTS, SamplingParams(temperature=0.0, max_new_tokens=10, seed=3))
        finally:
            close = getattr(backend, "shutdown", None)
            if close is not None:
                close()
    sglang, builtin = out["sglang"].samples, out["builtin"].samples
    assert [s.tokens for s in sglang] == [s.tokens for s in builtin]  # greedy: the same argmax everywhere
    assert sum(len(s.tokens) for s in sglang) > 20
    lp = [s.logprobs for s in sglang], [s.logprobs for s in builtin]
    assert mismatch_metrics(*lp)["k3_kl"] < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(*lp, strict=True)) < 1e-5
    assert all(torch.isfinite(s.logprobs).all() for s in sglang)
