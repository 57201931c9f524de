"""`trace-rl train --set rollout.backend=sglang`: the RL loop on SGLang's real Engine (on the
CPU), colocated in each run mode and disaggregated under torchrun (two trainer ranks and an
SGLang engine rank; two engine ranks against one), resumed after a kill, ended cleanly when its
SGLang engine dies, and `rollout.sglang` checked against SGLang's own ServerArgs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_rollout.sglang import EngineConfig
from sglang_rollout.sglang.config import server_arg_names
from sglang_rollout.sglang.session import CPU_SITE

ROOT = Path(__file__).resolve().parents[3]
# the embedded default, small: a short warm-up, two RL steps of two prompts x 4 samples
SHORT = ["rollout.backend=sglang", "sft.steps=10", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4",
         "rl.mini_batches=1", "checkpoint.every=0"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHON=sys.executable)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rollout_sglang_options_are_checked_against_sglangs_serverargs():
    # the field names read from SGLang's source equal the real dataclass's (imported with the CPU shims)
    code = ("import dataclasses, json; from sglang.srt.server_args import ServerArgs; "
            "print(json.dumps(sorted(f.name for f in dataclasses.fields(ServerArgs))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CPU_SITE), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert server_arg_names() == set(json.loads(run.stdout.splitlines()[-1]))
    assert EngineConfig(sglang={"mem_fraction_static": 0.5, "ep_size": 1}).sglang["ep_size"] == 1
    with pytest.raises(ValueError, match=r"\['mem_fraction'\] are not fields of SGLang's ServerArgs"):
        EngineConfig(sglang={"mem_fraction": 0.5})


def test_a_bad_sglang_option_stops_the_run_before_training(tmp_path):
    run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "train", "--set", "rollout.backend=sglang",
                          "--set", "rollout.sglang={max_total_token: 64}", "--set", f"output_dir={tmp_path}"],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "['max_total_token'] are not fields of SGLang's ServerArgs" in run.stderr
    assert not (tmp_path / "checkpoints").exists()  # refused at start: no warm-up ran


MODES = ("bf16", "fp4-rollout", "fp4-qat", "trace")


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """{mode: metrics rows} of a colocated run on SGLang per run mode (each its own process)."""
    rows = {}
    for mode in MODES:
        out = tmp_path_factory.mktemp(mode)
        args = [a for s in [*SHORT, f"rl.mode={mode}", f"output_dir={out}"] for a in ("--set", s)]
        run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "train", *args], env=_env(), cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"{mode}: {run.stderr[-3000:]}"
        rows[mode] = _rows(out)
    return rows


def test_colocated_training_on_sglang_in_each_run_mode(colocated):
    for mode, rows in colocated.items():
        assert [r["step"] for r in rows] == [0, 1], mode
        for r in rows:
            assert 0 <= r["reward"] <= 1 and r["weight_sync_bytes"] > 0 and r["response_tokens"] > 0, mode
    k3 = {mode: max(r["k3_kl"] for r in rows) for mode, rows in colocated.items()}
    for r in colocated["trace"]:  # SGLang's guidance applied: every one of its FP4 rounding decisions reproduced
        assert r["residual_flip_rate"] == 0 and r["flip_rate"] > 0
    for r in colocated["fp4-qat"]:  # the same flips measured, not followed
        assert r["flip_rate"] > 0
    # what remains in trace mode is BF16 operation order (SGLang's norms, rotary and router are not
    # the trainer's); FP4 without guidance is an order of magnitude and more further off
    assert k3["trace"] < 1e-4 and k3["bf16"] < 1e-3
    assert 10 * k3["trace"] < min(k3["fp4-rollout"], k3["fp4-qat"]), k3


def test_disaggregated_training_with_an_sglang_engine_rank(tmp_path):
    env = _env() | {"TRAINERS": "2", "ENGINES": "1"}
    sets = [*SHORT, "rl.mode=trace", "dist.ep=2", f"output_dir={tmp_path}"]
    run = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), *[a for s in sets for a in ("--set", s)]],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # guidance streamed from the SGLang engine rank to both trainer ranks and applied there
        assert r["residual_flip_rate"] == 0 and r["flip_rate"] > 0 and r["k3_kl"] < 1e-4
        assert r["weight_sync_bytes"] > 0 and r["guidance_bytes_per_token"] > 0


def test_a_killed_run_on_sglang_resumes_as_it_would_have_continued(tmp_path):
    """trace mode on a colocated SGLang engine, killed (SIGKILL) after its step-1 checkpoint: no
    SGLang process outlives it, and the resumed run (a new engine, loaded from the checkpoint)
    gives the uninterrupted run's metrics (SGLang samples from per-sample seeds)."""
    import time

    import psutil

    sets = [*[s for s in SHORT if not s.startswith(("rl.steps", "checkpoint.every"))], "rl.steps=3",
            "checkpoint.every=1", "rl.mode=trace"]

    def cmd(out):
        return [sys.executable, "-m", "megatron_trace.cli", "train",
                *[a for s in [*sets, f"output_dir={out}"] for a in ("--set", s)]]

    whole = subprocess.run(cmd(tmp_path / "whole"), env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd(killed), env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest, deadline = killed / "checkpoints" / "latest", time.time() + 900
    while not (latest.exists() and latest.read_text().strip() == "rl-000001") and proc.poll() is None:
        assert time.time() < deadline, "the run never reached its step-1 checkpoint"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "SGLang's processes should be running"
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, f"the killed run left processes behind: {[p.cmdline()[:3] for p in alive]}"
    resumed = subprocess.run(cmd(killed), env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    want, got = _rows(tmp_path / "whole"), _rows(killed)
    assert [r["step"] for r in got] == [0, 1, 2]
    untimed = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in (*want, *got)]
    assert untimed[3:] == untimed[:3]


def test_a_dead_sglang_engine_ends_every_rank_with_a_clear_message(tmp_path):
    """Disaggregated (a trainer rank and an SGLang engine rank): SGLang's host process killed
    after the first step ends the whole job, naming what died, within two minutes, and leaves
    no process behind."""
    import time

    import psutil

    env = _env() | {"TRAINERS": "1", "ENGINES": "1"}
    sets = [*[s for s in SHORT if not s.startswith("rl.steps")], "rl.steps=20", f"output_dir={tmp_path}"]
    proc = subprocess.Popen(["bash", str(ROOT / "launch" / "local.sh"), *[a for s in sets for a in ("--set", s)]],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 900
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.time() < deadline, "the run never finished its first step"
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    tree = psutil.Process(proc.pid).children(recursive=True)
    engine_rank = next(p for p in tree if p.environ().get("RANK") == "1")  # ranks: trainers, then engines
    # the host: the engine rank's spawned child that runs SGLang's processes (not the resource tracker)
    host = next(p for p in engine_rank.children() if "spawn_main" in " ".join(p.cmdline()) and p.children())
    host.kill()
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the job hung after its SGLang engine died") from None
    assert proc.returncode != 0
    assert "the SGLang engine's host process died" in stderr, stderr[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"processes left behind: {[p.cmdline()[:3] for p in alive]}"


def test_two_sglang_engine_ranks_give_the_run_one_gives(tmp_path):
    """3 groups over 2 SGLang engine ranks (2 + 1) against one engine rank: samples are seeded
    by their ids, so the step is the same."""
    rows = {}
    for engines in (1, 2):
        out = tmp_path / str(engines)
        env = _env() | {"TRAINERS": "1", "ENGINES": str(engines)}
        sets = [*[s for s in SHORT if not s.startswith(("rl.steps", "rl.prompts_per_step"))], "rl.steps=1",
                "rl.prompts_per_step=3", "rl.mode=trace", f"output_dir={out}"]
        run = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), *[a for s in sets for a in ("--set", s)]],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        (row,) = _rows(out)
        rows[engines] = {k: v for k, v in row.items() if not k.endswith("_s")}
    assert rows[1] == rows[2] and rows[2]["residual_flip_rate"] == 0
