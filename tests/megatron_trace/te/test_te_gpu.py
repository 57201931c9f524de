"""TRACE's TE recipe inside TE's own modules, on a GPU with TE built (bench/gpu_te.sh): te.Linear and
te.GroupedLinear under `autocast(recipe=CustomRecipe(trace_fp4_quantizer_factory))` against the
local spec's FP4 math (inputs per row, weights per tensor, BF16 GEMMs on the FP4 grid values),
forward and gradients. TE's extension needs CUDA: on a CPU machine this module is skipped, and
tests/megatron_trace/te/test_te_cpu.py covers the recipe against TE's Python classes there."""

from __future__ import annotations

import json

import pytest
import torch

te = pytest.importorskip("transformer_engine.pytorch", reason="TE with its extension: a GPU machine (bench/gpu_te.sh)")
if not torch.cuda.is_available():
    pytest.skip("TE's modules need CUDA", allow_module_level=True)

from transformer_engine.common.recipe import CustomRecipe  # noqa: E402

from megatron_trace.te.recipe import trace_fp4_quantizer_factory  # noqa: E402
from trace_kernels.fp4 import fake_quantize  # noqa: E402

RECIPE = CustomRecipe(qfactory=trace_fp4_quantizer_factory)


def fp4_rows(x):
    return fake_quantize(x, "nvfp4", scale="row", check_finite=False)


def fp4_tensor(w):
    return fake_quantize(w, "nvfp4", scale="tensor", check_finite=False)


def test_te_linear_runs_traces_fp4_math():
    torch.manual_seed(0)
    lin = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = (torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_()
    with te.autocast(enabled=True, recipe=RECIPE):
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = lin.weight.detach()
    xq, wq = fp4_rows(x.detach()), fp4_tensor(w)
    torch.testing.assert_close(y, xq @ wq.t(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, dy @ wq, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(lin.weight.grad, dy.t() @ xq, rtol=1.6e-2, atol=1e-2)
    assert not torch.allclose(y, x.detach() @ w.t(), rtol=1e-3, atol=1e-3)  # FP4 moved it


def test_te_grouped_linear_runs_traces_fp4_math():
    torch.manual_seed(1)
    splits = [48, 0, 80, 16]
    lin = te.GroupedLinear(len(splits), 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(sum(splits), 256, device="cuda", dtype=torch.bfloat16).requires_grad_()
    m_splits = torch.tensor(splits, dtype=torch.int64, device="cuda")
    with te.autocast(enabled=True, recipe=RECIPE):
        y = lin(x, m_splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    for i, (xi, dyi) in enumerate(zip(x.detach().split(splits), dy.split(splits), strict=True)):
        w = getattr(lin, f"weight{i}")
        wq = fp4_tensor(w.detach())
        lo = sum(splits[:i])
        torch.testing.assert_close(y[lo: lo + splits[i]], fp4_rows(xi) @ wq.t(), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(x.grad[lo: lo + splits[i]], dyi @ wq, rtol=1.6e-2, atol=1e-2)
        if splits[i]:
            torch.testing.assert_close(w.grad, dyi.t() @ fp4_rows(xi), rtol=1.6e-2, atol=1e-2)


# -- a tiny Megatron MoE on the TE spec against the local spec ----------------------------------
# The scenario of tests/megatron_trace/megatron/test_model_qat.py (an independent float32 engine
# records dense guidance and routed experts at every site of every layer), run on both specs.
from megatron_trace.megatron.spawn import spawn  # noqa: E402
from tests.megatron_trace.megatron import test_model_qat as qat_case  # noqa: E402
from tests.support import scenarios as sc  # noqa: E402

MODES = ["bf16", "fp4-rne", "fp4-guided"]


@pytest.fixture(scope="module")
def case():
    sd = sc.random_full_state_dict(qat_case.CFG)
    return sd, qat_case._batches(sd, "dense")


def _run(sd, batches, impl, **kw):
    strip = [{k: v for k, v in b.items() if k != "engine_logits"} for b in batches]
    return qat_case._merge(spawn(sc.run_layout, {}, cfg=qat_case.CFG, sd=sd, batches=strip, modes=MODES,
                                 backward=True, grouped_gemm=True, transformer_impl=impl, **kw))


@pytest.fixture(scope="module")
def runs(case):
    sd, batches = case
    return _run(sd, batches, "local"), _run(sd, batches, "transformer_engine")


def test_te_spec_reproduces_the_engines_codes_at_every_guided_site(runs):
    """trace mode on TE's linears: every (layer, site) gets the engine's codes and scales."""
    _, te_run = runs
    qat_case._assert_engine_codes(te_run)


def test_te_spec_computes_what_the_local_spec_does(case, runs):
    """The same weights: logits of every mode and the gradients agree with the local spec up to
    BF16 reduction order (TE's GEMMs against torch's), and FP4 really changes them."""
    local, te_run = runs
    for b in local:
        for mode in MODES:
            torch.testing.assert_close(te_run[b]["logits"][mode], local[b]["logits"][mode], atol=0.05, rtol=0.01,
                                       msg=lambda m, mode=mode, b=b: f"batch {b}, {mode}: {m}")
        assert not torch.equal(te_run[b]["logits"]["fp4-rne"], te_run[b]["logits"]["bf16"])
        assert all(te_run[b]["finite"])
        assert set(te_run[b]["grads"]) == set(local[b]["grads"])  # TE's grouped weights under the local names
        for name, g in te_run[b]["grads"].items():
            ref_g = local[b]["grads"][name]
            err = (g - ref_g).norm() / ref_g.norm().clamp_min(1e-12)
            assert err < 0.05, f"gradient of {name} differs by {float(err):.3f} (relative)"


def _save(rank, *, cfg, sd, directory, transformer_impl):
    from megatron_trace.checkpoint.dist import save_model
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.trainer import linears_for
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(cfg, "bf16", grouped_gemm=True, linears=linears_for(transformer_impl))
    load_full_state_dict(model, sd)
    save_model(model, cfg, directory)


def test_checkpoints_move_between_the_te_and_local_specs(case, runs, tmp_path):
    """A distributed checkpoint written by the TE spec loads into the local spec (and back) with
    the same logits: runs can switch transformer_impl."""
    sd, batches = case
    local, te_run = runs
    for writer, reader, want in (("transformer_engine", "local", local), ("local", "transformer_engine", te_run)):
        directory = tmp_path / writer
        spawn(_save, {}, cfg=qat_case.CFG, sd=sd, directory=str(directory), transformer_impl=writer)
        got = _run(None, batches[:1], reader, checkpoint=str(directory))
        torch.testing.assert_close(got[0]["logits"]["fp4-guided"], want[0]["logits"]["fp4-guided"], atol=1e-3,
                                   rtol=0, msg=f"written by {writer}, read by {reader}")


# -- the RL loop on the TE spec -----------------------------------------------------------------
def _train(rank, *, out_dir):
    from megatron_trace.cli import main

    main(["train", "--set", "sft.steps=20", "--set", "rl.steps=2", "--set", "rl.prompts_per_step=4",
          "--set", "rl.mode=trace", "--set", f"output_dir={out_dir}",
          "--set", "trainer.transformer_impl=transformer_engine"])


def test_the_rl_loop_trains_on_the_te_spec(tmp_path):
    """`trace-rl train` with trainer.transformer_impl=transformer_engine: SFT, rollouts on the
    built-in engine, guided updates on TE's linears, checkpoints (TE's modules save no recipe
    state Megatron would refuse) and the weight sync; in trace mode no rounding decision departs
    from the engine's (no residual flip) and k3_kl stays at the level of GPU reduction order.
    (On a GPU the tiny model's unguided FP4 trainer already rarely flips: 0 to 2e-4 of its
    elements on 2026-12-06, on both specs; the engine's codes at every site are checked against an
    independent engine in test_te_spec_reproduces_the_engines_codes_at_every_guided_site.)"""
    spawn(_train, {}, out_dir=str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 <= r["reward"] <= 1 and r["weight_sync_bytes"] > 0 and r["response_tokens"] > 0
        assert r["residual_flip_rate"] == 0 and r["guidance_bytes_per_token"] > 0 and r["k3_kl"] < 1e-5
    assert any((tmp_path / "checkpoints").glob("rl-*/state.pt"))  # saved through Megatron's TE extension
