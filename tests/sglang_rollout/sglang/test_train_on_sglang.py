"""`trace-rl train --set rollout.backend=sglang`: the RL loop on SGLang's real Engine (on the
CPU), colocated in each run mode and disaggregated under torchrun (two trainer ranks and an
SGLang engine rank; two engine ranks against one; an engine rank whose engine runs TP2),
resumed after a kill, ended cleanly when its SGLang engine dies, and `rollout.sglang` checked
against SGLang's own ServerArgs."""

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
    # SGLang's model computes the trainer's arithmetic (sglang/numerics.py): in trace mode the
    # log-probs agree to FP32 rounding, the built-in engine's level; FP4 without guidance is far off
    assert k3["trace"] < 1e-12 and k3["bf16"] < 1e-3
    assert 10 * k3["trace"] < min(k3["fp4-rollout"], k3["fp4-qat"]), k3


def test_a_deepseek_v3_shaped_model_trains_on_sglang_in_trace_mode(tmp_path):
    """`trace-rl train --set model.hf=DIR` of a tiny DeepSeek-V3 (transformers-built: MLA with a
    query latent and YaRN, a dense first layer, shared experts, sigmoid group-limited routing) on
    SGLang's own DeepSeek model: the Megatron trainer's weights synced into it (the two down
    projections under one global scale), its guidance and routed experts (MoE layers only) back:
    the trainer follows every rounding decision at every layer, to FP32 rounding."""
    from tests.support.hf_families import hf_model

    hf_model("deepseek-v3", num_hidden_layers=3)[1].save_pretrained(tmp_path / "hf")
    args = [a for s in [*SHORT, "sft.steps=2", "rl.mode=trace", f"model.hf={tmp_path / 'hf'}",
                        f"output_dir={tmp_path / 'run'}"] for a in ("--set", s)]
    run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "train", *args], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1] and all(r["response_tokens"] > 0 for r in rows)
    # measured: k3_kl 8.0e-15 and 5.7e-15, flip rates 1.9e-3 and 1.4e-3, all reproduced
    assert all(r["k3_kl"] < 1e-12 and r["residual_flip_rate"] == 0 and r["flip_rate"] > 0 for r in rows), rows
    assert all(set(r["flip_rate_by_layer"]) == {"0", "1", "2"} for r in rows)


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


# one RL step of 3 groups on one trainer rank, in trace mode: the runs that compare engine layouts
LAYOUT_RUN = [*[s for s in SHORT if not s.startswith(("rl.steps", "rl.prompts_per_step"))], "rl.steps=1",
              "rl.prompts_per_step=3", "rl.mode=trace"]


def _layout_run(out: Path, engines: int, sets=(), watch=None) -> dict:
    """launch/local.sh with one trainer rank and `engines` SGLang engine ranks: the step's row,
    untimed. watch(pids of the job's processes) is called about twice a second while it runs."""
    import contextlib
    import time

    import psutil

    env = _env() | {"TRAINERS": "1", "ENGINES": str(engines)}
    cmd = ["bash", str(ROOT / "launch" / "local.sh"),
           *[a for s in [*LAYOUT_RUN, *sets, f"output_dir={out}"] for a in ("--set", s)]]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stderr.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + 900
        while watch is not None and proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(psutil.Error):  # a process that ended while being looked at
                watch(psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.5)
        proc.wait(timeout=max(1, deadline - time.time()))
    assert proc.returncode == 0, (out / "stderr.log").read_text()[-3000:]
    (row,) = _rows(out)
    return {k: v for k, v in row.items() if not k.endswith("_s")}


@pytest.fixture(scope="module")
def one_engine_rank(tmp_path_factory) -> dict:
    """The step of one trainer rank and one SGLang engine rank of one GPU (TP1)."""
    return _layout_run(tmp_path_factory.mktemp("one-engine"), 1)


def test_two_sglang_engine_ranks_give_the_run_one_gives(tmp_path, one_engine_rank):
    """3 groups over 2 SGLang engine ranks (2 + 1) against one engine rank: samples are seeded
    by their ids, so the step is the same."""
    two = _layout_run(tmp_path, 2)
    assert one_engine_rank == two and two["residual_flip_rate"] == 0


def test_an_sglang_engine_rank_of_two_gpus(tmp_path, one_engine_rank):
    """dist.engine_tp=2: the engine rank's SGLang engine runs TP2 (two scheduler processes over
    gloo). It samples the TP1 engine's tokens (per-sample seeds; BF16 partial sums do not move
    this step's draws), the trainer follows every FP4 rounding decision of both TP ranks (their
    guidance slices merged back to whole rows), and the remaining mismatch is BF16 partial sums."""
    schedulers = set()

    def watch(procs):
        for p in procs:
            title = " ".join(p.cmdline())
            if title.startswith("sglang::scheduler"):
                schedulers.add(title.split()[0])

    tp2 = _layout_run(tmp_path, 1, ["dist.engine_tp=2"], watch=watch)
    assert schedulers == {"sglang::scheduler_TP0", "sglang::scheduler_TP1"}, schedulers
    for key in ("reward", "tokens", "response_tokens", "weight_sync_bytes", "guidance_bytes_per_token"):
        assert tp2[key] == one_engine_rank[key], (key, tp2[key], one_engine_rank[key])
    assert tp2["residual_flip_rate"] == 0 and tp2["flip_rate"] > 0
    assert tp2["k3_kl"] < 1e-4
