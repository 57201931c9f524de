"""`trace-rl train` under torchrun: two trainer ranks (expert parallel, so also data parallel)
and one engine rank over gloo, started by launch/local.sh; then resumed from its checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _launch(out_dir, steps, *extra, layout="dist.ep=2", engines=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", TRAINERS="2", ENGINES=str(engines),
               PYTHON=sys.executable)
    return subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--set", layout, "--set", "sft.steps=10",
                           "--set", f"rl.steps={steps}", "--set", "rl.prompts_per_step=4", "--set",
                           f"output_dir={out_dir}", *extra], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_two_trainer_ranks_and_an_engine_rank_train_and_resume(tmp_path):
    signal = ("--set", "task.digits=1", "--set", "sft.steps=40")  # rewards that differ within groups
    run = _launch(tmp_path, 2, "--set", "rl.kl_coef=0.05", "--set", "rl.dynamic_sampling=true", *signal)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["k3_kl"] < 1e-9  # guidance streamed to its trainer ranks, applied under EP x DP
        assert 0 <= r["reward"] <= 1 and r["weight_sync_bytes"] > 0 and r["guidance_bytes_per_token"] > 0
        assert r["kl_ref"] >= 0 and r["rollout_rounds"] >= 1  # collective refill rounds
    assert any(r["trained_groups"] > 0 for r in rows)
    assert (tmp_path / "checkpoints" / "rl-000002" / "optimizer-rank1.pt").exists()
    more = _launch(tmp_path, 3, "--set", "rl.kl_coef=0.05", "--set", "rl.dynamic_sampling=true", *signal)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resuming from" in more.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


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
    rates by layer included."""
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
    assert rows[1] == rows[2] and all(r["k3_kl"] < 1e-9 and r["kl_ref"] > 0 for r in rows[2])
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
