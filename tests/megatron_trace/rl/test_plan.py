"""`trace-rl plan` against hand counts, against what the real parts hold (Megatron's parameter
shards, its DDP gradient buffers and optimizer state, the engine's buffers, a rollout's
guidance, sparse records), against independent arithmetic of the large configs' memory and
traffic, and against a measured run's peak memory."""

import dataclasses
import json
import math
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
    SPARSE_BITS_PER_KEPT,
    SPARSE_KEPT,
    Architecture,
    GiB,
    Layout,
    MiB,
    architecture,
    choose_layout,
    engine_kv_blocks,
    expert_id_bytes,
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
    assert plan.trainer["parameters (BF16, norms FP32)"] == 2 * 107_392 + 2 * norms
    assert plan.trainer["gradient buffer (FP32 main_grad)"] == 4 * 107_392
    # FP32 main copies of the BF16 parameters (the FP32 norms are their own), exp_avg and exp_avg_sq
    assert plan.trainer["optimizer state (FP32 main params + AdamW moments)"] == 4 * (107_392 - norms) + 8 * 107_392
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


@pytest.mark.parametrize(("prompt_tokens", "new_tokens"), [(16, 59), (5, 20), (40, 16), (1, 1), (33, 100)])
def test_the_kv_cache_admits_every_group_at_once_whatever_the_prompts_length(prompt_tokens, new_tokens):
    """The engine's own worst-case accounting (its scheduler) of groups whose prompts have any
    length up to rl.max_prompt_tokens fits the cache the plan sizes: a whole step's groups are
    admitted at once, not in waves (a 13-token prompt needs more blocks than a 16-token one)."""
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig
    from sglang_rollout.engine.scheduler import Scheduler

    groups, group_size = 16, 8
    capacity = kv_blocks(groups, group_size, prompt_tokens, new_tokens)
    scheduler = Scheduler(PRESETS["tiny"], EngineConfig(num_blocks=capacity), cache=None, share_prompts=True)
    sampling = SamplingParams(max_new_tokens=new_tokens)
    worst = max(scheduler._worst_blocks(p, group_size, sampling) for p in range(1, prompt_tokens + 1))
    assert groups * worst <= capacity
    assert groups * scheduler._worst_blocks(prompt_tokens, group_size, sampling) <= capacity


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
    ids = [t for part in [*g.groups.values(), *g.samples.values()] for t in part.routed_experts.values()]
    # the engine records int64 ids; they travel as the smallest type that holds 4 experts (uint8)
    assert sum(t.numel() for t in ids) * expert_id_bytes(TINY) == g.num_tokens * routed_expert_bytes_per_token(TINY)
    sparse = TraceEngine(cfg, EngineConfig(precision="fp4", guide="all", coding="sparse",
                                           num_blocks=engine_kv_blocks(run)))
    sparse.update_weights(sd, 0)
    gs = sparse.generate([GroupRequest(f"g{i}", tuple(range(1 + i, 6 + i)), 1) for i in range(3)],
                         SamplingParams(max_new_tokens=6, seed=0)).guidance
    assert gs.guidance_nbytes == pytest.approx(gs.num_tokens * guidance_bytes_per_token(TINY, 2, "sparse"), rel=0.1)


def test_large_layouts_fit_or_are_refused_with_the_shortfall():
    qwen235 = load_config(None, ["model.preset=qwen3-235b-a22b", "cluster.nodes=1", "dist.engine_ranks=4"])
    arch = Architecture.from_model_config("qwen3-235b-a22b", PRESETS["qwen3-235b-a22b"])
    plan = make_plan(qwen235, arch)
    assert not plan.fits and any("GiB more than the" in p for p in plan.problems)
    assert make_plan(qwen235, arch, Layout(tp=3)).problems[0].startswith("4 trainer GPUs do not divide")
    cfg = load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml")
    assert make_plan(cfg, arch).fits
    one_gpu_engines = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml",
                                            ["dist.engine_tp=1", "rollout.backend=builtin"]), arch)
    assert one_gpu_engines.problems == [p for p in one_gpu_engines.problems if p.startswith("engine GPU needs")]
    assert one_gpu_engines.problems[0].endswith("dist.engine_tp=2 fits (SGLang engines)")  # 132 GiB of FP4 weights
    best = choose_layout(cfg, arch)[0]
    assert best.fits and best.trainer_peak <= best.limits["gpu"]
    ds = load_config(ROOT / "launch" / "configs" / "deepseek-v3.yaml")
    plan = make_plan(ds, architecture(ds))
    assert 671.0e9 < plan.arch.num_params < 671.1e9  # DeepSeek-V3 as released: 671 B without its MTP module
    # its memory fits with the distributed optimizer and SGLang engines of TP8, which count TRACE's FP4
    # latent cells (420 B per token and layer) and start with FP4 sites packed (no BF16 shard at any point)
    assert plan.fits, plan.problems
    assert plan.sglang.kv_bytes_per_token == plan.sglang.sglang_bytes_per_token == 61 * 420
    assert 40 * GiB < plan.engine["weights (FP4 codes + scales; SGLang TP8)"] < 50 * GiB
    # the built-in engine builds all of it too, YaRN included, but runs on one GPU
    builtin_cfg = load_config(ROOT / "launch" / "configs" / "deepseek-v3.yaml", ["rollout.backend=builtin"])
    assert make_plan(builtin_cfg, architecture(builtin_cfg)).problems == [
        "dist.engine_tp=8: the built-in engine runs on one GPU (engine tensor parallelism runs on SGLang engines, "
        "rollout.backend=sglang)"]


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
    assert train.returncode != 0 and "for trace-rl plan only (the DeepSpeed trainer lacks its " \
        "multi-head latent attention" in train.stderr


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


def run_optimizer_state(rank, distributed):
    """This rank's bytes of Megatron's optimizer state (FP32 main parameters that are not model
    parameters, AdamW's moments) and DDP gradient buffers, summed from the live tensors after a
    step; its parameters and parameter tensors."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_trace.megatron.model import build_model

    model = build_model(PRESETS["tiny"], "bf16", grouped_gemm=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=distributed), [ddp],
                                 use_gloo_process_groups=False)
    for p in model.parameters():
        p.main_grad.zero_()
    opt.step()  # torch's Adam allocates its moments at the first step
    model_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    mains = [p for o in inner for g in o.param_groups for p in g["params"]
             if p.untyped_storage().data_ptr() not in model_storage]  # an FP32 parameter is its own main
    moments = [t for o in inner for st in o.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    return {"optimizer": sum(t.numel() * t.element_size() for t in mains + moments),
            "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "params": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters()))}


@pytest.mark.parametrize("layout", [dict(dp=2), dict(ep=2, dp=2)])
def test_optimizer_state_per_rank_equals_megatrons_live_tensors(layout):
    """Per-rank optimizer bytes of Megatron's distributed optimizer (`optim.distributed`) are 1/DP
    of the replicated optimizer's for dense parameters and 1/expert-DP for experts (DP2: both
    halved; EP2 x DP2: experts not sharded, each rank holding its own); the FP32 gradient buffer is
    full on every rank. Measured from the live tensors of get_megatron_optimizer over gloo."""
    gpus = layout["dp"]
    cfg = load_config(None, ["model.preset=tiny", "dist.engine_ranks=1", f"cluster.gpus_per_node={gpus + 1}",
                             f"dist.ep={layout.get('ep', 1)}"])
    for distributed in (True, False):
        live = spawn(run_optimizer_state, layout, distributed=distributed)
        plan = make_plan(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, distributed=distributed)),
                         TINY)
        planned = plan.trainer["optimizer state (FP32 main params + AdamW moments)"]
        # the shards are equal ranges of each padded buffer: per rank the plan up to the padding
        # that falls in the rank's range, over the ranks exactly the parameters' bytes
        assert sum(r["optimizer"] for r in live) == pytest.approx(gpus * planned, abs=1e-6), (layout, live, planned)
        assert all(abs(r["optimizer"] - planned) <= 12 * 64 * 4 for r in live), (layout, live, planned)
        grads = plan.trainer["gradient buffer (FP32 main_grad)"]
        for r in live:  # full on every rank; Megatron aligns each parameter to 64 elements (and a bucket to DP)
            assert grads == 4 * r["params"] and 0 <= r["grads"] - grads <= 4 * 64 * (r["tensors"] + 1), (r, grads)
        if distributed:
            sharded = planned
        else:
            replicated = planned
    held = live[0]["params"]
    norms = 2 * (2 * 64 + 2 * 16) + 64
    expert = 2 * 4 * 3 * 64 * 32 // layout.get("ep", 1)  # 2 layers of 4 experts, gate/up/down
    assert replicated == 4 * (held - norms) + 8 * held  # independent of the plan's parameter count
    assert sharded == pytest.approx(replicated / 2 if "ep" not in layout else (replicated - 12 * expert) / 2
                                    + 12 * expert)


def run_offloaded_state(rank):
    """optim.cpu_offload on the tiny model: this rank's bytes of the host optimizer's tensors
    after a step (FP32 masters it steps, gradient copies, moments), and of FP32 main parameters
    left beside the model on the device."""
    from megatron_trace.config import OptimSection
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.optimizer import TrainerOptimizer

    model = build_model(PRESETS["tiny"], "bf16", grouped_gemm=True)
    opt = TrainerOptimizer(model, 1e-3, OptimSection(distributed=True, cpu_offload=True, lr_warmup_steps=0))
    opt.zero_grad()
    opt.step()
    (hdo,) = [o.optimizer for o in opt.optimizer.chained_optimizers]
    host = list(hdo.gpu_params_map_cpu_copy.values()) + list(hdo.cpu_copy_map_grad.values())
    host += [t for o in hdo.sub_optimizers for st in o.state.values() for t in st.values()
             if torch.is_tensor(t) and t.dim() and all(t is not h for h in host)]
    model_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    device_mains = [p for g in hdo.param_groups for p in g["params"]
                    if p.untyped_storage().data_ptr() not in model_storage]
    return {"host": sum(t.numel() * t.element_size() for t in host),
            "device": sum(t.numel() * t.element_size() for t in device_mains)}


def test_offloaded_optimizer_state_is_the_plans_host_bytes():
    """optim.cpu_offload: the plan puts 16 B per sharded parameter on the host (FP32 master,
    gradient copy, two moments) and none on the GPU; measured from the live tensors of the
    offloading optimizer at DP2 over gloo (CPU patch P9 makes its host copies distinct tensors)."""
    cfg = load_config(None, ["model.preset=tiny", "dist.engine_ranks=1", "cluster.gpus_per_node=3",
                             "optim.cpu_offload=true"])
    live = spawn(run_offloaded_state, {"dp": 2})
    plan = make_plan(cfg, TINY)
    assert plan.trainer["optimizer state (FP32 main params + AdamW moments)"] == 0
    per_rank = plan.host["trainer node: offloaded optimizer state"] / 2
    assert all(r["device"] == 0 for r in live)
    assert sum(r["host"] for r in live) == pytest.approx(2 * per_rank, abs=16 * 64 * 2), (live, per_rank)
    assert "offloaded" in plan.optimizer


def test_sparse_guidance_bytes_are_the_measured_ones():
    """Sparse guidance (rl.coding=sparse) is counted from its measured kept fraction, not as the
    dense upper bound: the plan's formula gives back the bench's measured bits per element
    (bench/results/guidance_bytes_2026-11-30.md, tau 2, scale LSBs) and the tiny model's
    (bench/results/mismatch_tiny_sparse_2026-11-30.json), and a live sparse record of other
    activations within 15 %."""
    from megatron_trace.guidance import capture
    from trace_kernels.fp4 import quantize

    bench = json.loads((ROOT / "bench" / "results" / "guidance_bytes_2026-11-30.json").read_text())
    row = next(r for r in bench["rows"] if r["coding"] == "sparse tau=2, scale LSBs")
    assert row["kept_elements"] == pytest.approx(SPARSE_KEPT, rel=0.01)
    assert row["bits_per_element"] == pytest.approx(32 / 2048 + 1 / 16 + SPARSE_KEPT * SPARSE_BITS_PER_KEPT, rel=0.01)
    tiny = json.loads((ROOT / "bench" / "results" / "mismatch_tiny_sparse_2026-11-30.json").read_text())["trace"]
    per_token = 2 * (64 + 64 + 64 + 2 * 32 + 2 * 16 + 2 * 16)  # elements of the tiny model's 6 sites, 2 layers
    assert 8 * guidance_bytes_per_token(TINY, 2, "sparse") / per_token == pytest.approx(
        tiny["guidance_bits_per_element"], rel=0.05)
    assert guidance_bytes_per_token(TINY, 2, "sparse") < guidance_bytes_per_token(TINY, 2) / 1.9
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 1024, generator=g) * torch.exp(0.8 * torch.randn(1, 1024, generator=g))).bfloat16()
    y = (x.float() @ (torch.randn(1024, 4096, generator=g) / 32).bfloat16().float()).bfloat16()
    rec = capture(y, quantize(y, scale="row"), model_id="t", layer=0, site="fc1", sample_id="0", weight_version=0,
                  policy="all", coding="sparse")
    assert rec.nbytes == pytest.approx(64 * (4 + 4096 / 128 + 4096 * SPARSE_KEPT * SPARSE_BITS_PER_KEPT / 8), rel=0.15)
    for coding in ("dense", "sparse"):  # the plan's guidance traffic follows the configured coding
        plan = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml", [f"rl.coding={coding}"]),
                         Architecture.from_model_config("q", PRESETS["qwen3-235b-a22b"]))
        assert plan.traffic[f"guidance to the trainers ({coding})"] == 64 * (1024 + 8 * 8192) * \
            guidance_bytes_per_token(plan.arch, 32, coding)


def _qwen235_by_hand(tp, ep):
    """(dense, FP32 norms, expert) parameters one GPU holds of Qwen3-235B-A22B (PP1), from the HF
    shape: hidden 4096, 94 layers, 64 query + 4 KV heads of 128, 128 experts of 1536, vocab 151936."""
    h, L, d, E, f, V = 4096, 94, 128, 128, 1536, 151936
    attn = h * d * (64 + 2 * 4) + 64 * d * h
    norms = L * (2 * h + 2 * d) + h
    dense = L * (attn / tp + E * h) + norms + 2 * V * h / tp  # routers and norms whole on every TP rank
    return dense, norms, L * E * 3 * h * f / ep


def test_large_configs_memory_and_traffic_by_independent_arithmetic():
    """The 235 B example config (TP4 EP64 DP16 on 64 trainer GPUs, 16 engine GPUs in 4 SGLang
    engines of TP4, 2 nodes away): sharded optimizer, grad buffer, offload, bucketed sync and every
    traffic figure with its seconds, from the model's shape and the cluster's links."""
    cfg = load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml")
    arch = Architecture.from_model_config("q", PRESETS["qwen3-235b-a22b"])
    plan = make_plan(cfg, arch)
    dense, norms, expert = _qwen235_by_hand(4, 64)
    dp, edp = 16, 1  # 64 / TP4; experts: 64 / EP64
    assert (plan.dp, plan.expert_dp) == (dp, edp)
    assert plan.trainer["gradient buffer (FP32 main_grad)"] == pytest.approx(4 * (dense + expert))
    opt = plan.trainer["optimizer state (FP32 main params + AdamW moments)"]
    assert opt == pytest.approx((4 * (dense - norms) + 8 * dense) / dp + 12 * expert / edp)
    off = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml", ["optim.cpu_offload=true"]), arch)
    assert off.trainer["optimizer state (FP32 main params + AdamW moments)"] == 0  # precision-aware
    assert off.host["trainer node: offloaded optimizer state"] == pytest.approx(8 * 16 * (dense / dp + expert))
    keep = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml", [
        "optim.cpu_offload=true", "optim.megatron={use_precision_aware_optimizer: false}"]), arch)
    assert keep.trainer["optimizer state (FP32 main params + AdamW moments)"] == pytest.approx(
        4 * ((dense - norms) / dp + expert))
    repl = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml", ["optim.distributed=false"]),
                     arch)
    assert repl.trainer["optimizer state (FP32 main params + AdamW moments)"] == pytest.approx(
        12 * (dense + expert) - 4 * norms)
    # the sync: no gather, one 256 MiB bucket per rank (GPU and host), every engine the packed model
    assert not any("gather to" in k for k in plan.traffic) and not any("rank 0" in k for k in plan.host)
    assert plan.trainer["weight sync bucket (packed)"] == 256 * MiB
    assert plan.host["trainer node: one sync bucket per rank"] == 8 * 256 * MiB
    packed = arch.fp4_params * (0.5 + 1 / 16) + 2 * (arch.num_params - arch.fp4_params)
    ib = 400e9 / 8  # bytes/s per GPU between nodes
    assert plan.traffic["weight sync to the engines (packed FP4)"] == pytest.approx(4 * packed)  # 4 engines
    assert plan.seconds["weight sync to the engines (packed FP4)"] == pytest.approx(4 * packed / 16 / ib)
    tokens = 64 * (1024 + 8 * 8192)  # prompts once per group
    sites = [(1, 4096), (1, 64 * 128), (1, 4096), (8, 1536), (4, 128), (4, 128)]
    dense_guidance = 32 * sum(r * (4 + c / 16 + c / 8) for r, c in sites)  # deep:32
    assert plan.traffic["guidance to the trainers (dense)"] == pytest.approx(tokens * dense_guidance)
    assert plan.seconds["guidance to the trainers (dense)"] == pytest.approx(tokens * dense_guidance / 16 / ib)
    assert plan.traffic["routed expert ids (uint8)"] == tokens * 94 * 8
    red = "gradient reduce-scatter + parameter all-gather, per GPU"
    assert plan.traffic[red] == pytest.approx((dp - 1) / dp * (6 * dense + 2 * norms))  # expert-DP 1: no reduction
    assert plan.seconds[red] == pytest.approx(plan.traffic[red] / ib)
    assert repl.traffic["gradient all-reduce, per GPU"] == pytest.approx(2 * (dp - 1) / dp * 4 * dense)
    # without EP the distributed optimizer holds exactly 1/DP of the replicated one's state
    one = load_config(ROOT / "launch" / "configs" / "qwen3-30b-a3b.yaml", ["dist.engine_ranks=1", "dist.tp=1",
                                                                           "dist.ep=1", "dist.etp=1"])
    a30 = Architecture.from_model_config("q30", PRESETS["qwen3-30b-a3b"])
    sharded = make_plan(one, a30).trainer["optimizer state (FP32 main params + AdamW moments)"]
    full = make_plan(dataclasses.replace(one, optim=dataclasses.replace(one.optim, distributed=False)),
                     a30).trainer["optimizer state (FP32 main params + AdamW moments)"]
    assert sharded == pytest.approx(full / 7)  # 7 trainer GPUs: DP7, expert-DP7
    assert expert_id_bytes(dataclasses.replace(arch, experts=512)) == 2 and expert_id_bytes(arch) == 1
    assert 60 * GiB < packed < 140 * GiB


def _qwen235_engine_gpu_by_hand(tp, ep, fp4=True):
    """Bytes of weights on one GPU of an SGLang engine of Qwen3-235B-A22B under tp_size
    `tp`, ep_size `ep`, from the HF shape: attention and vocabulary split over TP (4 KV heads: one
    per GPU at TP4), experts over EP and their width over tp / ep, norms FP32 and routers BF16 whole."""
    h, L, d, E, f, V = 4096, 94, 128, 128, 1536, 151936
    attention = h * d * (64 // tp + 2 * max(1, 4 // tp)) + 64 // tp * d * h
    experts = (E // ep) * 3 * h * (f // (tp // ep))
    sites = L * (attention + experts)
    rest = 2 * (2 * V * h / tp + L * E * h) + 4 * (L * (2 * h + 2 * d) + h)
    return sites * (0.5 + 1 / 16 if fp4 else 2) + rest


def test_sglang_engine_gpus_of_the_235b_config_by_independent_arithmetic():
    """`rollout.backend=sglang` (the 235 B config: 16 engine GPUs, engine TP4): per engine GPU the
    FP4 weights of SGLang's shard, SGLang's default mem_fraction_static for 141 GiB, its KV budget
    and the NVFP4 pool for the step's in-flight samples, the workspace; EP holds the same bytes;
    TP2 fits too: the engine's start holds no BF16 shard (FP4 sites are created packed)."""
    from megatron_trace.rl.plan_sglang import default_mem_fraction_static

    arch = Architecture.from_model_config("q", PRESETS["qwen3-235b-a22b"])
    plan = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml"), arch)
    assert plan.fits, plan.problems
    held = _qwen235_engine_gpu_by_hand(4, 1)
    sg = plan.sglang
    assert plan.engine["weights (FP4 codes + scales; SGLang TP4)"] == pytest.approx(held)
    # trace mode records guidance, so TRACE turns CUDA graphs off: SGLang reserves 512 MiB + 1.5 MiB
    # per token of its 8192-token chunked prefill + 128 MiB per TP rank of the 144384 MiB
    assert sg.mem_fraction_static == round((141 * 1024 - (512 + 8192 * 1.5 + 4 * 128)) / (141 * 1024), 3) == 0.908
    assert sg.kv_budget == pytest.approx(0.908 * 141 * GiB - held)
    # per token on a GPU: 94 layers x K,V x 1 KV head x (64 code bytes + 8 scale bytes + a float32 scale);
    # SGLang divides its budget by BF16 cells: 94 x 1 head x (128 + 128) x 2 bytes
    assert (sg.kv_bytes_per_token, sg.sglang_bytes_per_token) == (94 * 2 * (64 + 8 + 4), 94 * 256 * 2)
    need = 64 // 4 * (1024 + 8 * 8192)  # 4 engines: 16 groups each, prompts once per group
    # TRACE's max_total_tokens: the step's share in 16-token blocks, each sample's partial block at its worst
    asked = 64 // 4 * (1024 // 16 + 8 * math.ceil((15 + 8192) / 16)) * 16
    assert sg.tokens_needed == need and sg.tokens_admitted == asked == need + 64 // 4 * 8 * 16
    assert sg.tokens_fit == int((0.908 * 141 * GiB - held) // (94 * 2 * 76)) > asked
    assert plan.engine[f"KV pool (TRACE NVFP4, {asked} tokens)"] == asked * 94 * 2 * 76
    # the workspace measured at hidden 2048 x 8192 prefill tokens without CUDA graphs (2.34 GiB, rounded
    # to 2.4), twice that at hidden 4096 (bench/results/sglang_workspace_2026-12-02_h200.md)
    assert plan.engine["workspace (no CUDA graphs; measured)"] == pytest.approx(2.4 * GiB * 4096 / 2048)
    assert plan.engine["weight sync bucket (received)"] == 256 * MiB
    assert plan.engine["weight sync bucket (the next, being checked)"] == 256 * MiB
    # SGLang puts sliced weights together on the host: the trainer's TP shards arrive rank after rank,
    # so up to the whole packed model per engine rank (2 engines of TP4 on an 8-GPU node)
    assert plan.layout.tp == 4
    assert plan.host["engine node: sliced weights put together, per SGLang engine rank"] == pytest.approx(
        2 * (arch.fp4_params * (0.5 + 1 / 16) + 2 * (arch.num_params - arch.fp4_params)))
    ep = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml",
                               ["rollout.sglang={ep_size: 4}"]), arch)
    assert ep.engine["weights (FP4 codes + scales; SGLang TP4 EP4)"] == pytest.approx(
        _qwen235_engine_gpu_by_hand(4, 4)) == pytest.approx(held)
    tp2 = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml", ["dist.engine_tp=2"]), arch)
    tp2_held = _qwen235_engine_gpu_by_hand(2, 1)
    assert tp2.fits, tp2.problems
    assert tp2.engine["weights (FP4 codes + scales; SGLang TP2)"] == pytest.approx(tp2_held)
    assert 60 * GiB < tp2_held < 65 * GiB  # in BF16 its FP4 sites alone would be 219 GiB
    # a lower fraction than the pool needs: SGLang admits fewer tokens than the step holds
    low = make_plan(load_config(ROOT / "launch" / "configs" / "qwen3-235b-a22b.yaml",
                                ["rollout.sglang={mem_fraction_static: 0.26}"]), arch)
    admitted = int((0.26 * 141 * GiB - held) // (94 * 256 * 2))
    assert low.sglang.tokens_admitted == admitted < need
    assert low.problems[0].startswith(f"SGLang engine: its KV pool admits {admitted} tokens, the step's "
                                      f"in-flight samples need {need}")
    # CUDA graphs on (no guidance recorded): SGLang also reserves 2 MiB per decode batch (512 at TP4)
    # and 8 MiB per prefill graph (58 token counts up to 8192)
    assert default_mem_fraction_static(141, 4, True) == round((144384 - (13312 + 512 * 2 + 58 * 8)) / 144384, 3)
    # an 80 GiB GPU at TP2: the same chunk; a 24 GiB one: chunks of 2048; above 60 GiB at least 10 GiB reserved
    assert default_mem_fraction_static(80, 2, False) == round((81920 - (512 + 12288 + 256)) / 81920, 3)
    assert default_mem_fraction_static(141, 1, False, chunked_prefill_size=2048) == round(
        (144384 - 10240) / 144384, 3)
    assert default_mem_fraction_static(24, 1, False) == round((24576 - (512 + 2048 * 1.5 + 128)) / 24576, 3)


def test_sglang_engine_layouts_sglang_would_pad_are_refused():
    """SGLang pads each moe-TP rank's expert width to a multiple of 32; TRACE refuses that layout
    (padded FP4 rows are not the trainer's): Qwen3-235B's 1536 over TP8 without EP is 192 (fine),
    over TP16 96 (fine), the 30B's 768 over TP16 48 (refused), and EP that does not divide TP."""
    from megatron_trace.rl.plan_sglang import layout_problems

    a235 = Architecture.from_model_config("q", PRESETS["qwen3-235b-a22b"])
    a30 = Architecture.from_model_config("q30", PRESETS["qwen3-30b-a3b"])
    assert layout_problems(a235, 8, 1) == [] and layout_problems(a235, 16, 1) == []
    assert "would be padded to a multiple of 32" in layout_problems(a30, 16, 1)[0]
    assert layout_problems(a30, 16, 2) == []  # 768 / 8
    assert "ep_size 3 does not divide dist.engine_tp=4" in layout_problems(a30, 4, 3)[0]


@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), (3, False), (3, True)])
def test_deepspeed_trainer_memory_follows_zero_partitioning(tmp_path, stage, offload):
    """trainer.backend=deepspeed on 8 trainer GPUs: the plan's parameter, gradient and optimizer
    bytes per GPU are DeepSpeed's ZeRO memory model (2 + 4 + 12 B per parameter, each divided by
    DP from the stage that partitions it) over the parameter count transformers' own model of the
    checkpoint's config has."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_trace.checkpoint.hf_layout import hf_config
    from megatron_trace.rl.plan import architecture

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config(PRESETS["tiny"])))
    model.save_pretrained(tmp_path)
    params = sum(p.numel() for p in model.parameters())
    zero = {"stage": stage} | ({"offload_optimizer": {"device": "cpu"}} if offload else {})
    cfg = load_config(None, [f"model.hf={tmp_path}", "trainer.backend=deepspeed", "dist.engine_ranks=1",
                             "cluster.gpus_per_node=9", f"trainer.deepspeed={json.dumps({'zero_optimization': zero})}"])
    plan = make_plan(cfg, architecture(cfg))
    dp = 8
    assert plan.dp == dp and plan.optimizer == f"DeepSpeed ZeRO-{stage}"
    want = {"parameters (BF16)": 2 * params / (dp if stage == 3 else 1),
            "gradients (FP32)": 4 * params / (dp if stage >= 2 else 1),
            "optimizer state (FP32 masters + AdamW moments)": 0 if offload else 12 * params / dp}
    for key, value in want.items():
        assert plan.trainer[key] == pytest.approx(value, rel=1e-9), key
    host = plan.host.get("trainer node: offloaded optimizer state", 0)
    assert host == pytest.approx(8 * 12 * params / dp if offload else 0)
