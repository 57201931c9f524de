"""`trace-rl plan` against hand counts, against what the real parts hold (Megatron's parameter
shards, the engine's buffers, a rollout's guidance) and against a measured run's peak memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_trace.config import load_config
from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from megatron_trace.rl.plan import (
    PLAN_ONLY,
    Architecture,
    Layout,
    choose_layout,
    engine_kv_blocks,
    guidance_bytes_per_token,
    kv_blocks,
    make_plan,
    routed_expert_bytes_per_token,
)

ROOT = Path(__file__).resolve().parents[3]
TINY = Architecture.from_model_config("tiny", PRESETS["tiny"])


def test_tiny_parameter_count_by_hand():
    # vocab 256, hidden 64, 2 layers, 4 query heads + 2 KV heads of 16, 4 experts of 32, top-2
    attention = 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64  # QKV, output projection
    experts = 4 * 3 * 64 * 32  # gate, up, down
    per_layer = attention + experts + 4 * 64 + 2 * 64 + 2 * 16  # + router, 2 norms, q/k norms
    assert TINY.num_params == 2 * per_layer + 2 * 256 * 64 + 64 == 107_392
    plan = make_plan(load_config(None, ["model.preset=tiny"]), TINY)
    norms = 2 * (2 * 64 + 2 * 16) + 64  # float32 in Megatron and in the engine
    assert (plan.trainer["parameters (BF16, norms FP32)"] == 2 * 107_392 + 2 * norms
            and plan.trainer["FP32 masters + AdamW moments"] == 12 * 107_392)
    fp4 = 2 * (attention + experts)  # the FP4 sites, dequantized for backward + a 1-byte STE mask
    assert plan.trainer["QAT weight copies + STE masks"] == 3 * fp4
    # FP4 engine: codes (1/2 byte) + E4M3 scale per 16 (1/16 byte) per FP4 weight; the rest BF16,
    # the norms and the router (2 layers of 4 x 64) float32
    fp32 = norms + 2 * 4 * 64
    assert plan.engine["weights (FP4 codes + scales)"] == fp4 * (0.5 + 1 / 16) + 2 * (107_392 - fp4 - fp32) + 4 * fp32


def run_shard_sizes(rank):
    from megatron_trace.megatron.model import build_model

    model = build_model(PRESETS["tiny"], "bf16", grouped_gemm=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2, dp=2), dict(pp=2), dict(tp=2, ep=2, etp=1)])
def test_parameters_per_gpu_equal_megatrons_shards(layout):
    """The plan's per-GPU parameter bytes are the bytes Megatron allocates on the fullest rank."""
    held = max(spawn(run_shard_sizes, layout))
    gpus = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    cfg = load_config(None, ["model.preset=tiny", "dist.engine_ranks=1", "cluster.gpus_per_node=" + str(gpus + 1)])
    lay = Layout(layout.get("tp", 1), layout.get("ep", 1), layout.get("pp", 1), layout.get("etp", layout.get("tp", 1)))
    plan = make_plan(cfg, TINY, lay)
    assert plan.trainer["parameters (BF16, norms FP32)"] == held, (layout, plan.trainer, held)


def test_engine_and_guidance_bytes_equal_the_engines():
    """KV-cache bytes per token, FP4 weight bytes and guidance bytes per token, against the
    engine's own buffers and a real rollout's records (one sample per prompt: nothing shared)."""
    from megatron_trace.rollout import GroupRequest, SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine
    from tests.support import scenarios as sc

    cfg = PRESETS["tiny"]
    run = load_config(None, ["model.preset=tiny", "rl.prompts_per_step=3", "rl.group_size=2",
                             "rl.max_prompt_tokens=5", "rl.max_new_tokens=20"])
    # 3 groups: one block of prompt each + 2 samples of ceil(25 / 16) blocks
    assert engine_kv_blocks(run) == kv_blocks(3, 2, 5, 20) == 3 * (1 + 2 * 2)
    engine = TraceEngine(cfg, EngineConfig(precision="fp4", guide="all", num_blocks=engine_kv_blocks(run)))
    sd = sc.random_full_state_dict(cfg, seed=1)
    engine.update_weights(sd, 0)
    held = sum(t.numel() * t.element_size() for layer in engine.cache.k + engine.cache.v for t in layer.values())
    slots = engine.engine_cfg.num_blocks * engine.engine_cfg.block_size
    plan = make_plan(run, TINY)
    assert plan.engine["KV cache"] == held and held / slots == 2 * 2 * 2 * (8 + 1 + 4)  # K,V x layers x heads
    storages = {}  # every buffer the engine holds once (experts' entries are views of stacks)
    for t in [*engine.weights.tensors.values(), *engine.weights.stacked.values()]:
        parts = [t.codes, getattr(t, "block_scales", getattr(t, "scales", None))] if hasattr(t, "codes") else [t]
        for p in parts:
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    assert plan.engine["weights (FP4 codes + scales)"] == sum(storages.values())  # norms, router in float32
    out = engine.generate([GroupRequest(f"g{i}", tuple(range(1 + i, 6 + i)), 1) for i in range(3)],
                          SamplingParams(max_new_tokens=6, seed=0))
    g = out.guidance
    assert g.guidance_nbytes == g.num_tokens * guidance_bytes_per_token(TINY, 2)
    assert g.nbytes - g.guidance_nbytes == g.num_tokens * routed_expert_bytes_per_token(TINY)


def test_large_layouts_fit_or_are_refused_with_the_shortfall():
    qwen235 = load_config(None, ["model.preset=qwen3-235b-a22b", "cluster.nodes=1", "dist.engine_ranks=4"])
    arch = Architecture.from_model_config("qwen3-235b-a22b", PRESETS["qwen3-235b-a22b"])
    plan = make_plan(qwen235, arch)
    assert not plan.fits and any("GiB more than the" in p for p in plan.problems)
    assert make_plan(qwen235, arch, Layout(tp=3)).problems[0].startswith("4 trainer GPUs do not divide")
    cfg = load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml")
    assert make_plan(cfg, arch).fits
    one_gpu_engines = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml",
                                            ["dist.engine_tp=1"]), arch)
    assert one_gpu_engines.problems == [p for p in one_gpu_engines.problems if p.startswith("engine GPU needs")]
    assert one_gpu_engines.problems[0].endswith("dist.engine_tp=2 fits")  # 235 B in FP4 is 132 GiB of weights
    best = choose_layout(cfg, arch)[0]
    assert best.fits and best.trainer_peak <= best.limits["gpu"]
    ds = load_config(ROOT / "launch" / "configs" / "deepseek-v3.yaml")
    plan = make_plan(ds, PLAN_ONLY["deepseek-v3"])
    assert 660e9 < PLAN_ONLY["deepseek-v3"].num_params < 690e9  # 671 B without the MTP module
    assert plan.problems and "plan-only" in plan.problems[-1]


def test_plan_command_and_a_config_that_cannot_train(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "plan", "--config",
                          str(ROOT / "launch" / "configs" / "qwen3-30b-a3b.yaml"), "--json", str(tmp_path / "p.json")],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FITS" in run.stdout and json.loads((tmp_path / "p.json").read_text())[0]["fits"]
    bad = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "plan", "--config",
                          str(ROOT / "launch" / "configs" / "qwen3-30b-a3b.yaml"),
                          "--set", "cluster.gpu_memory_gib=40"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "DOES NOT FIT" in bad.stdout and "GiB more than the" in bad.stdout
    train = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "train", "--set", "model.preset=deepseek-v3"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert train.returncode != 0 and "plan-only" in train.stderr


def test_plan_agrees_with_a_measured_runs_peak_memory(tmp_path):
    """Two colocated RL steps of the `small` model (28 M parameters) on the CPU: the plan's trainer
    peak plus engine against the measured peak RSS above the post-import baseline."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_memory.py"), "--out", str(tmp_path / "m")],
                         env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads((tmp_path / "m.json").read_text())
    assert r["measured_bytes"] > 500 * 2**20  # the model's state, not the interpreter, dominates
    assert 0.9 < r["ratio"] < 1.1, r["ratio"]


def test_plan_is_exact_for_static_state_of_a_real_trainer():
    """Parameters, gradients, FP32 masters and AdamW moments of a real trainer after a step,
    summed from the live tensors, equal the plan's static items."""
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.spawn import init_one_process
    from megatron_trace.rl.optim import MasterAdamW

    init_one_process()
    model = build_model(PRESETS["tiny"], "bf16", grouped_gemm=True)
    opt = MasterAdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.opt.state.values() for t in s.values() if t.dim())
    masters = sum(m.numel() * m.element_size() for m in opt.master)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    plan = make_plan(load_config(None, ["model.preset=tiny"]), TINY)
    assert plan.trainer["FP32 masters + AdamW moments"] == masters + state
    assert plan.trainer["gradients (as the parameters)"] == grads
