"""Evaluation on held-out problems: the Wilson interval, accuracy counting, and an FP4 export
read back into the engine as the bytes it serves."""

import math

import pytest
import torch

from megatron_trace.checkpoint.fp4_export import load_fp4_export
from megatron_trace.rl.evaluate import Z95, evaluate, wilson_interval
from megatron_trace.rl.tasks import EOS, ChainTask
from megatron_trace.rollout import RolloutOutput, SampleResult


def _wilson_by_quadratic(k: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson interval as the roots p of (k/n - p)^2 = z^2 p (1 - p) / n, in float64."""
    ph = k / n
    a, b, c = 1 + z * z / n, -(2 * ph + z * z / n), ph * ph
    disc = math.sqrt(b * b - 4 * a * c)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@pytest.mark.parametrize(("k", "n"), [(0, 1), (1, 1), (0, 10), (3, 10), (10, 10), (37, 100), (250, 500),
                                      (499, 500), (1, 2000)])
def test_wilson_interval_matches_the_quadratics_roots(k, n):
    lo, hi = wilson_interval(k, n)
    want_lo, want_hi = _wilson_by_quadratic(k, n, Z95)
    assert lo == pytest.approx(max(0.0, want_lo), abs=1e-12) and hi == pytest.approx(min(1.0, want_hi), abs=1e-12)
    assert 0 <= lo <= k / n <= hi <= 1


def test_wilson_interval_known_values_and_limits():
    # 95%: z = the normal's 97.5% quantile
    assert math.erf(Z95 / math.sqrt(2)) == pytest.approx(0.95, abs=1e-12)
    lo, hi = wilson_interval(0, 16)
    assert lo == 0 and hi == pytest.approx(Z95**2 / (16 + Z95**2), rel=1e-12)  # k=0: [0, z^2 / (n + z^2)]
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)  # the textbook value
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


class _ScriptedBackend:
    """Answers each chain problem right when its index is even (and says "; 0" otherwise)."""

    def __init__(self, task, problems):
        self.task, self.problems = task, problems
        self.right = {tuple(task.prompt_ids(p)): i % 2 == 0 for i, p in enumerate(problems)}
        self.calls = []

    def generate(self, requests, sampling):
        assert sampling.temperature == 0 and sampling.stop_token_ids == (EOS,)
        self.calls.append(len(requests))
        samples = []
        for req in requests:
            p = next(q for q in self.problems if tuple(self.task.prompt_ids(q)) == req.prompt_ids)
            text = self.task.response(p) if self.right[req.prompt_ids] else "1+1 = 2; 0"
            tokens = [*self.task.tokenizer.encode(text), EOS]
            samples.append(SampleResult(sample_id=f"{req.group_id}/0", group_id=req.group_id,
                                        prompt_len=len(req.prompt_ids), tokens=tokens,
                                        logprobs=torch.zeros(len(tokens)), finish_reason="stop", weight_version=0))
        return RolloutOutput(samples=samples)


def test_evaluate_counts_correct_greedy_responses_in_batches():
    task = ChainTask(digits=2, ops="+-", terms=4)
    problems = [p for p in task.eval_problems(11, seed=0) if p.answer != "0"]  # "; 0" is wrong for the rest
    backend = _ScriptedBackend(task, problems)
    result = evaluate(backend, task, problems, max_new_tokens=64, batch=4)
    n = len(problems)
    assert backend.calls == [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert (result.correct, result.total) == ((n + 1) // 2, n)
    assert result.accuracy == result.correct / n and (result.lo, result.hi) == wilson_interval(result.correct, n)
    assert result.examples[0]["reward"] == 1.0 and result.examples[1]["reward"] == 0.0 and result.truncated == 0


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_an_fp4_export_loads_back_as_the_engines_own_quantization(tmp_path, fmt):
    from megatron_trace.checkpoint.fp4_export import export_fp4
    from megatron_trace.checkpoint.hf_layout import hf_config
    from megatron_trace.model_config import PRESETS, fp4_site_of
    from megatron_trace.rollout import GroupRequest, SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from tests.support.scenarios import random_full_state_dict
    from trace_kernels.fp4 import QTensor, quantize

    cfg = PRESETS["tiny"]
    sd = random_full_state_dict(cfg, seed=3)
    amax = {(L, s): 1.0 for L in range(cfg.num_layers) for s in ("qkv", "proj", "fc1", "fc2")}
    export_fp4(sd.items(), cfg, hf_config(cfg), tmp_path / "fp4", fmt, amax)
    loaded_cfg, loaded = load_fp4_export(tmp_path / "fp4")
    assert loaded_cfg == cfg and set(loaded) == set(sd)
    for name, w in sd.items():
        if fp4_site_of(name) is None:
            assert torch.equal(loaded[name], w.to(torch.bfloat16)), name
            continue
        q, want = loaded[name], quantize(w, "nvfp4")
        assert isinstance(q, QTensor) and torch.equal(q.codes, want.codes), name
        assert torch.equal(q.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8)), name
        if fmt == "modelopt":
            assert torch.equal(q.global_scale, want.global_scale), name
        else:  # stored as its reciprocal: back within an ulp
            assert torch.allclose(q.global_scale, want.global_scale, rtol=2**-23), name
    if fmt != "modelopt":
        return
    # served by the FP4 engine: the same greedy tokens as the engine quantizing the BF16 weights itself
    reqs = [GroupRequest("a", (1, 5, 9, 13), n=1), GroupRequest("b", (1, 7, 7, 20, 3), n=1)]
    outs = []
    for state in ({k: (v.to(torch.bfloat16) if fp4_site_of(k) is None else v) for k, v in sd.items()}, loaded):
        engine = TraceEngine(cfg, EngineConfig(precision="fp4", num_blocks=16))
        engine.update_weights(state, 0)
        outs.append(engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=6)))
    for a, b in zip(*[o.samples for o in outs], strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
