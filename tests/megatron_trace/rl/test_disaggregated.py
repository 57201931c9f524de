"""`trace-rl train` under torchrun: two trainer ranks (expert parallel, so also data parallel)
and one engine rank over gloo, started by launch/local.sh; then resumed from its checkpoint."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _launch(out_dir, steps, *extra, layout="dist.ep=2", engines=1, trainers=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", TRAINERS=str(trainers), ENGINES=str(engines),
               PYTHON=sys.executable)
    return subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--set", layout, "--set", "sft.steps=10",
                           "--set", f"rl.steps={steps}", "--set", "rl.prompts_per_step=4", "--set",
                           f"output_dir={out_dir}", *extra], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_trainer_ranks_train_and_resume_under_other_layouts(tmp_path):
    """DP2 with the distributed optimizer, 3 steps; its step-2 checkpoint (model and optimizer
    state as Megatron distributed checkpoints) resumes under one trainer rank and under TP2, and
    the resumed step is the uninterrupted run's: the same rollout, and the same loss and gradient
    norm up to the layouts' reduction order (TP2 with expert TP 1 gives the experts an optimizer
    of their own: the saved state is regrouped)."""
    signal = ("--set", "task.digits=1", "--set", "sft.steps=40", "--set", "rl.kl_coef=0.05",
              "--set", "checkpoint.every=1",  # rewards that differ within groups
              "--set", "rl.mini_batches=1")  # each rank splits its own groups: mini-batches follow the DP size
    base = tmp_path / "dp2"
    run = _launch(base, 3, *signal, layout="dist.ep=1")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(base)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["k3_kl"] < 1e-9  # guidance streamed to its trainer ranks, applied under DP
        assert 0 <= r["reward"] <= 1 and r["weight_sync_bytes"] > 0 and r["guidance_bytes_per_token"] > 0
        assert r["kl_ref"] >= 0 and r["grad_norm"] > 0
    assert (base / "checkpoints" / "rl-000002" / "optimizer" / "metadata.json").exists()
    resumed = {}
    for name, trainers, layout in (("dp1", 1, "dist.ep=1"), ("tp2", 2, "dist.tp=2")):
        out = tmp_path / name
        shutil.copytree(base, out)
        shutil.rmtree(out / "checkpoints" / "rl-000003")
        (out / "checkpoints" / "latest").write_text("rl-000002\n")
        more = _launch(out, 3, *signal, layout=layout, trainers=trainers)
        assert more.returncode == 0, more.stderr[-3000:]
        assert "resuming from" in more.stdout and "rl-000002" in more.stdout
        got = _rows(out)
        assert [r["step"] for r in got] == [0, 1, 2] and got[:2] == rows[:2]
        resumed[name] = got[2]
        # the same rollout (the DP2 run's reward: the mean of two equal shares' means)
        assert got[2]["reward"] == rows[2]["reward"] and got[2]["k3_kl"] < 1e-2, name
        # the gradient norm is of the global batch's gradient in every layout
        assert abs(got[2]["grad_norm"] - rows[2]["grad_norm"]) <= 2e-2 * rows[2]["grad_norm"], name
    for key in ("loss", "grad_norm"):  # one data-parallel rank in both: the same metrics' meaning
        a, b = resumed["dp1"][key], resumed["tp2"][key]  # TP2's BF16 reductions: k3 ~1e-3 (loss ~1e-3 here)
        assert abs(a - b) <= 2e-2 * abs(a) + 2e-4, (key, a, b)


@pytest.mark.parametrize("mode", ["bf16", "fp4-rollout", "fp4-qat"])
def test_each_other_run_mode_runs_disaggregated(tmp_path, mode):
    run = _launch(tmp_path, 1, "--set", f"rl.mode={mode}", "--set", "checkpoint.every=0")
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= row["reward"] <= 1 and row["k3_kl"] >= 0 and row["weight_sync_bytes"] > 0
    if mode == "fp4-rollout":  # a BF16 trainer against the FP4 engine: the mismatch TRACE removes
        assert row["k3_kl"] > 1e-6


def test_tensor_parallel_trainers_run(tmp_path):
    """TP2 with sequence parallelism: micro-batches padded to an even token count, guidance rows
    sliced by column and by token across the two ranks. Measured k3_kl ~1.5e-3 here, the same
    as TP2 in bf16 mode (1.7e-3): BF16 reductions of the TP path, not FP4 rounding (EP2: 4e-15)."""
    run = _launch(tmp_path, 1, "--set", "checkpoint.every=0", layout="dist.tp=2")
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["k3_kl"] < 1e-2 and row["guidance_bytes_per_token"] > 0


def test_two_engine_ranks_give_the_run_one_gives(tmp_path):
    """5 groups over 2 engines (3 + 2) and 2 data-parallel trainer ranks (3 + 2, crossing the
    engines' split): samples are seeded by their ids, so the run is the same as with one engine."""
    rows = {}
    for engines in (1, 2):
        run = _launch(tmp_path / str(engines), 1, "--set", "rl.prompts_per_step=5", "--set", "checkpoint.every=0",
                      engines=engines)
        assert run.returncode == 0, run.stderr[-3000:]
        (row,) = [json.loads(line) for line in (tmp_path / str(engines) / "metrics.jsonl").read_text().splitlines()]
        rows[engines] = {k: v for k, v in row.items() if not k.endswith("_s")}
    assert rows[1] == rows[2] and rows[2]["k3_kl"] < 1e-9


def test_pipeline_parallel_trainers_reproduce_one_trainer(tmp_path):
    """From one warmed-up checkpoint, two pipeline stages (Megatron's schedule, activations and
    gradients between them) give exactly the metrics of one trainer rank, KL reference and flip
    rates by layer included (the gradient norm up to FP32 summation order)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-m", "megatron_trace.cli", "sft", "--set", "sft.steps=5", "--set",
                    f"output_dir={tmp_path / 'sft'}"], env=env, cwd=ROOT, check=True, capture_output=True)
    start = tmp_path / "sft" / "checkpoints" / "rl-000000" / "model"
    rows = {}
    for trainers, pp in ((1, 1), (2, 2)):
        run = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--set", f"dist.pp={pp}",
                              "--set", "sft.steps=0", "--set", f"model.megatron={start}", "--set", "rl.steps=2",
                              "--set", "rl.prompts_per_step=4", "--set", "checkpoint.every=0",
                              "--set", "rl.kl_coef=0.05", "--set",
                              f"output_dir={tmp_path / str(pp)}"], env=env | {"TRAINERS": str(trainers),
                              "PYTHON": sys.executable}, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        rows[pp] = [{k: v for k, v in r.items() if not k.endswith("_s")}
                    for r in map(json.loads, (tmp_path / str(pp) / "metrics.jsonl").read_text().splitlines())]
    # the gradient norm sums the stages' squares across the pipeline: the same up to FP32 order
    for one, two in zip(rows[1], rows[2], strict=True):
        a, b = one.pop("grad_norm"), two.pop("grad_norm")
        assert abs(a - b) <= 1e-5 * a, (a, b)
        a, b = one.pop("weight_sync_bytes"), two.pop("weight_sync_bytes")  # each stage's buckets carry headers
        assert abs(a - b) <= 1e-2 * a, (a, b)
    diff = [(k, r1[k], r2.get(k)) for r1, r2 in zip(rows[1], rows[2], strict=True) for k in r1 if r1[k] != r2.get(k)]
    assert rows[1] == rows[2], diff
    assert all(r["k3_kl"] < 1e-9 and r["kl_ref"] > 0 for r in rows[2])
    assert all(set(r["flip_rate_by_layer"]) == {"0", "1"} for r in rows[2])  # each stage counted its layer


@pytest.mark.parametrize("layout", [("dist.tp=1",), ("dist.tp=2", "--set", "dist.ep=2", "--set", "dist.etp=1")])
def test_a_budget_policy_under_torchrun(tmp_path, layout):
    """budget:100 measured across two trainer ranks (data parallel; or tensor and expert
    parallel, each rank counting its shards and dispatched rows; flip counts summed) picks one of
    the demo model's two layers (~81 bytes per token each), as it does colocated."""
    run = _launch(tmp_path, 1, "--set", "rl.guide=budget:100", "--set", "checkpoint.every=1", *layout[1:],
                  layout=layout[0])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "budget:100: guiding layers:" in run.stdout
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    guided = torch.load(tmp_path / "checkpoints" / "rl-000001" / "state.pt", weights_only=False)["state"]["guide"]
    assert guided in ("layers:0", "layers:1") and set(row["flip_rate_by_layer"]) == {guided[-1]}
    assert row["residual_flip_rate"] == 0 and row["guidance_bytes_per_token"] < 120


def test_a_failing_rank_ends_the_whole_job(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": 2}\n')
    run = _launch(tmp_path, 2, "--set", "task.kind=jsonl", "--set", f"task.path={bad}", "--set",
                  "task.reward=no.such:fn")  # every trainer rank fails at start; the engine must not hang
    assert run.returncode != 0 and "cannot import" in run.stderr
