"""The DeepSpeed trainer behind the RL loop: the same HF checkpoint trained by GRPO steps under
Megatron and under DeepSpeed on the same rollouts, and `trace-rl train` with
trainer.backend=deepspeed (colocated; stopped and resumed)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_trace.megatron.spawn import spawn
from megatron_trace.model_config import PRESETS
from tests.support import deepspeed_cpu
from tests.support import scenarios as sc
from tests.support.hf_models import hf_from_megatron

CFG = PRESETS["tiny"]
LR, STEPS = 1e-3, 3
PROMPTS = [(1, 2, 3, 4), (9, 8, 7), (5, 6), (7, 7, 7)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An HF checkpoint of random tiny weights (norms BF16-valued: what both trainers hold alike)."""
    path = tmp_path_factory.mktemp("hf")
    sd = sc.random_full_state_dict(CFG, seed=3)
    hf_from_megatron({k: v.bfloat16().float() if v.dtype == torch.float32 else v for k, v in sd.items()}, path)
    return path


def reward_low_ids(prompt, response):
    return sum(t < 128 for t in response) / max(len(response), 1)


def grpo_steps(rank, *, backend, hf_dir, zero_stage=2, correction="none", mini_batches=2, mode="trace",
               steps=STEPS, threshold=1.02):
    """`steps` GRPO steps (in `mode`) on rollouts of the checkpoint's own weights (the same
    batches whatever the trainer), each data-parallel rank training on its share of the groups.
    Returns each step's metrics and the final weights under Megatron's names (rank 0)."""
    from megatron_trace.checkpoint.hf import HFCheckpoint
    from megatron_trace.config import OptimSection, RLSection
    from megatron_trace.rl.disaggregated import dp_share
    from megatron_trace.rl.ranks import data_parallel
    from megatron_trace.rl.rollout_batch import rollout
    from megatron_trace.rl.step import train_on
    from megatron_trace.rollout import SamplingParams
    from sglang_rollout.engine import EngineConfig, TraceEngine

    optim = OptimSection(lr_warmup_steps=0, clip_grad=1.0)
    if backend == "deepspeed":
        from megatron_trace.deepspeed.trainer import DeepSpeedTrainer
        from megatron_trace.deepspeed.weights import megatron_weights

        trainer = DeepSpeedTrainer.build(CFG, str(hf_dir), {"zero_optimization": {"stage": zero_stage}}, optim)
    else:
        from megatron_trace.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer.build(CFG, optim, hf=str(hf_dir))
    trainer.start_phase(LR)
    engine = TraceEngine(CFG, EngineConfig(precision="fp4", guide="all" if mode == "trace" else "none"))
    engine.update_weights(dict(HFCheckpoint(hf_dir).items()), 0)
    rl = RLSection(mode=mode, group_size=4, correction=correction, correction_threshold=threshold,
                   mini_batches=mini_batches)
    dp_rank, dp_size, _ = data_parallel()
    metrics = []
    for step in range(steps):
        batch = rollout(engine, PROMPTS, reward_low_ids, rl.group_size, SamplingParams(max_new_tokens=8, seed=step),
                        step)
        metrics.append(train_on(trainer, batch.select(list(dp_share(batch.num_groups, dp_rank, dp_size))), rl))
    if backend == "deepspeed":
        weights = {n: t.float() for n, t in megatron_weights(trainer.module, CFG)}
    else:
        weights = {n: t.detach().float().clone() for n, t in trainer.model.state_dict().items()
                   if not n.endswith("_extra_state")}
    return {"metrics": metrics, "weights": weights if rank == 0 else None}


def _moved(run, hf_dir):
    from megatron_trace.checkpoint.hf import HFCheckpoint

    start = dict(HFCheckpoint(hf_dir).items())
    return {n: (w - start[n].float()) for n, w in run["weights"].items()}


def test_megatron_and_deepspeed_train_the_same_checkpoint_alike(hf_dir):
    """Three GRPO steps of two updates each (trace mode) on the same rollouts from the same HF
    checkpoint. On the checkpoint's weights the two trainers agree: both follow the engine's codes
    (k3_kl < 1e-9, no residual flips, the same flip rate) and their gradients have the same norm
    to 0.2%. Then they drift as their optimizers differ: Megatron keeps norm weights in FP32,
    DeepSpeed's bf16 mode in BF16 (an update of 1e-3 to a weight near 1 is below a BF16 step), and
    Adam's first steps move every weight by about the learning rate whatever its gradient's size,
    so tiny gradients that differ in sign move weights apart by 2 lr. Measured: the matrices'
    total updates have cosine 0.991 and differ by 13% of their norm; the test allows 0.97 and 25%."""
    meg = spawn(grpo_steps, {}, backend="megatron", hf_dir=hf_dir)[0]
    ds = deepspeed_cpu.spawn(grpo_steps, world=1, backend="deepspeed", hf_dir=hf_dir)[0]
    first_m, first_d = meg["metrics"][0], ds["metrics"][0]
    assert first_m["reward"] == first_d["reward"] and first_m["k3_kl"] < 1e-9 and first_d["k3_kl"] < 1e-9
    assert first_d["residual_flip_rate"] == 0 and first_d["flip_rate"] == first_m["flip_rate"] > 0
    assert abs(first_m["grad_norm"] - first_d["grad_norm"]) <= 2e-3 * first_m["grad_norm"]
    for m, d in zip(meg["metrics"], ds["metrics"], strict=True):  # both guided: the engine's codes
        assert d["residual_flip_rate"] == 0 and d["k3_kl"] < 0.1 and m["k3_kl"] < 0.1
    dm, dd = _moved(meg, hf_dir), _moved(ds, hf_dir)
    assert set(dm) == set(dd)
    mats = sorted(n for n in dm if dm[n].dim() == 2)
    a, b = (torch.cat([d[n].flatten() for n in mats]) for d in (dm, dd))
    assert float(a @ b / (a.norm() * b.norm())) >= 0.97 and float((a - b).norm()) <= 0.25 * float(a.norm())


def test_masked_is_normalises_by_the_kept_tokens_as_megatron_does(hf_dir):
    """fp4-rollout with masked IS rejecting samples: DeepSpeed cannot rescale gradients between
    its reduction and its update, so its loss divides by the kept tokens counted from the old
    log-probs before the backward; Megatron rescales the reduced gradients after it. One step on
    the same rollout: the same kept fraction, the same loss to 1e-5, gradient norms to 0.2%."""
    kw = dict(hf_dir=hf_dir, correction="mis", threshold=2.0, mini_batches=1, mode="fp4-rollout", steps=1)
    (meg,) = spawn(grpo_steps, {}, backend="megatron", **kw)[0]["metrics"]
    (ds,) = deepspeed_cpu.spawn(grpo_steps, world=1, backend="deepspeed", **kw)[0]["metrics"]
    assert 0 < ds["kept_frac"] == meg["kept_frac"] < 1
    assert abs(ds["loss"] - meg["loss"]) <= 1e-5 * abs(meg["loss"]) and meg["loss"] != 0
    assert abs(ds["grad_norm"] - meg["grad_norm"]) <= 2e-3 * meg["grad_norm"]


def test_zero3_on_two_ranks_trains_as_one_process(hf_dir):
    """The same steps on 2 ZeRO-3 ranks, each training on its share of the groups, against one
    process (one update per step: a mini-batch then holds the same groups either way): gradient
    norms to 1e-4; the weights' updates to 6% of their size (measured 2.7%: Adam's first steps
    move a weight by about the learning rate whatever its gradient's size, so gradients near 0
    that the two-rank reduction rounds to the other sign move it the other way)."""
    kw = dict(hf_dir=hf_dir, zero_stage=3, mini_batches=1)
    one = deepspeed_cpu.spawn(grpo_steps, world=1, backend="deepspeed", **kw)[0]
    two = deepspeed_cpu.spawn(grpo_steps, world=2, backend="deepspeed", **kw)
    for a, b in zip(one["metrics"], two[0]["metrics"], strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    d1, d2 = _moved(one, hf_dir), _moved(two[0], hf_dir)
    num = sum(float((d1[n] - d2[n]).norm() ** 2) for n in d1) ** 0.5
    den = sum(float(d1[n].norm() ** 2) for n in d1) ** 0.5
    assert den > 0 and num <= 0.06 * den, (num, den)


def run_cli(rank, *, argv):
    from megatron_trace.cli import main

    main(argv)


def _cli(out_dir, hf_dir, *extra, module="tests.support.deepspeed_cli"):
    """`trace-rl train` with trainer.backend=deepspeed (ZeRO-3, trace mode, a KL penalty), as a command."""
    import sys

    return [sys.executable, "-m", module, "train", "--set", f"model.hf={hf_dir}", "--set", "trainer.backend=deepspeed",
            "--set", "trainer.deepspeed={zero_optimization: {stage: 3}}", "--set", "sft.steps=10",
            "--set", "rl.steps=4", "--set", "rl.prompts_per_step=4", "--set", "rl.mode=trace",
            "--set", "rl.kl_coef=0.01", "--set", "checkpoint.every=1", "--set", f"output_dir={out_dir}",
            *[a for kv in extra for a in ("--set", kv)]]


def _untimed(out_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s") and "per_s" not in k}
            for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_trace_rl_train_on_deepspeed_resumes_a_killed_run_as_it_would_have_continued(tmp_path):
    """`trace-rl train` with trainer.backend=deepspeed on a tiny checkpoint written by transformers
    (ZeRO-3, trace mode, a KL penalty): SFT then RL, the engine's codes followed; a run killed
    (SIGKILL) after its step-2 checkpoint and started again gives the uninterrupted run's metrics
    exactly. A run checkpoint holds the model as an HF checkpoint that TRACE's reader loads, beside
    DeepSpeed's own."""
    import os
    import subprocess

    from megatron_trace.checkpoint.hf import HFCheckpoint
    from tests.support.hf_models import save_hf_tiny
    from tests.support.kill import kill_at_checkpoint

    hf = tmp_path / "hf"
    save_hf_tiny(hf, seed=4)
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    subprocess.run(_cli(tmp_path / "whole", hf), env=env, check=True, capture_output=True)
    whole = _untimed(tmp_path / "whole")
    assert [r["step"] for r in whole] == [0, 1, 2, 3] and whole[0]["k3_kl"] < 1e-9
    assert all(r["residual_flip_rate"] == 0 and r["kl_ref"] >= 0 for r in whole)
    killed = tmp_path / "killed"
    assert not kill_at_checkpoint(_cli(killed, hf), killed, "rl-000002", env)
    resumed = subprocess.run(_cli(killed, hf), env=env, check=True, capture_output=True, text=True)
    assert "resuming from" in resumed.stdout
    assert _untimed(killed) == whole
    ckpt = tmp_path / "whole" / "checkpoints" / "rl-000004"
    assert (ckpt / "deepspeed" / "state").is_dir()
    assert HFCheckpoint(ckpt / "model").model_cfg == HFCheckpoint(hf).model_cfg


def test_mismatch_and_audit_with_the_deepspeed_trainer(tmp_path, hf_dir):
    """`trace-rl mismatch --trainer deepspeed` on an HF checkpoint measures what the Megatron
    trainer's run measures (the same rollouts; the same flip rates; trace mode at the engine's
    codes), and `trace-rl audit --trainer deepspeed` finds every site at the engine's precision."""
    argv = ["mismatch", "--hf", str(hf_dir), "--prompt-source", "random", "--prompts", "2", "--max-new-tokens", "6"]
    spawn(run_cli, {}, argv=[*argv, "--json", str(tmp_path / "m.json")])
    deepspeed_cpu.spawn(run_cli, world=1, argv=[*argv, "--trainer", "deepspeed", "--json", str(tmp_path / "d.json")])
    meg, ds = (json.loads((tmp_path / f).read_text()) for f in ("m.json", "d.json"))
    assert set(ds) == set(meg) == {"bf16", "fp4-rollout", "fp4-qat", "trace"}
    for mode in meg:
        for key in ("flip_rate", "residual_flip_rate"):
            assert ds[mode].get(key) == meg[mode].get(key), (mode, key)
        assert abs(ds[mode]["k3_kl"] - meg[mode]["k3_kl"]) <= 1e-6 + 0.01 * meg[mode]["k3_kl"], mode
    assert ds["trace"]["k3_kl"] < 1e-9 and ds["trace"]["residual_flip_rate"] == 0
    assert ds["fp4-rollout"]["k3_kl"] > 1e-4  # a mismatch there to measure
    spawn(run_cli, {}, argv=["audit", "--model", "tiny", "--trainer", "deepspeed"])  # SystemExit on a disagreement


def _torchrun(out_dir, hf_dir, trainers, *extra):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(trainers + 1),
           "-m", "tests.support.deepspeed_cli", "train", "--set", "dist.engine_ranks=1",
           "--set", f"model.hf={hf_dir}", "--set", "trainer.backend=deepspeed",
           "--set", "trainer.deepspeed={zero_optimization: {stage: 3}}", "--set", "sft.steps=10",
           "--set", "rl.steps=2", "--set", "rl.prompts_per_step=4", "--set", "rl.mode=trace",
           "--set", f"output_dir={out_dir}", *[a for kv in extra for a in ("--set", kv)]]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_zero3_trainer_ranks_and_an_engine_rank_under_torchrun(tmp_path, hf_dir):
    """`trace-rl train` disaggregated with the DeepSpeed trainer: 2 ZeRO-3 trainer ranks (each the
    data-parallel owner of its groups) and 1 engine rank, weights synced from trainer rank 0 after
    every step, against 1 trainer rank: the same SFT'd model and first rollout (the same reward),
    the engine's codes followed on both (k3_kl < 1e-9 on the first step)."""
    sums = tmp_path / "sums.jsonl"  # a reward that the SFT'd model earns in part: a signal in every group
    sums.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a, b in zip(range(3, 99, 7), range(50, 2, -3), strict=False)))
    task = ["task.kind=jsonl", f"task.path={sums}", "task.reward=tests.support.rewards:ones_share"]
    two = _torchrun(tmp_path / "two", hf_dir, 2, *task)
    one = _torchrun(tmp_path / "one", hf_dir, 1, *task)
    assert [r["step"] for r in two] == [0, 1] and two[0]["weight_sync_bytes"] > 0
    assert two[0]["k3_kl"] < 1e-9 and one[0]["k3_kl"] < 1e-9 and two[0]["residual_flip_rate"] == 0
    assert two[0]["reward"] == one[0]["reward"] > 0 and two[0]["grad_norm"] > 0
