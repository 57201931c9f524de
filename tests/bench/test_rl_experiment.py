"""bench/rl_experiment.py without training: its modes, how it keeps finished work across
sessions, and the report it writes from a recorded state."""

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.support.bench_scripts import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rx():
    yield from bench_module("rl_experiment")


def test_modes_name_their_settings_and_how_they_are_served(rx):
    assert rx.mode_sets("trace-deep4") == ["rl.mode=trace", "rl.guide=deep:4"]
    assert rx.mode_sets("trace-sparse") == ["rl.mode=trace", "rl.guide=all", "rl.coding=sparse"]
    assert rx.mode_sets("bf16") == ["rl.mode=bf16"]
    with pytest.raises(SystemExit, match="unknown mode"):
        rx.mode_sets("trace-deep")
    assert rx.eval_kinds("bf16") == ["bf16", "ptq-fp4"] and rx.eval_kinds("trace-all") == ["fp4-export"]
    # a learning-rate sweep: the mode's own rl.lr comes after the experiment's, so it wins
    assert rx.mode_sets("bf16@lr=1e-5") == ["rl.mode=bf16", "rl.lr=1e-5"]
    assert rx.eval_kinds("bf16@lr=1e-5") == ["bf16", "ptq-fp4"]
    assert rx.eval_kinds("trace-deep4@lr=3e-6") == ["fp4-export"]
    for bad in ("bf16@lr=", "bf16@lr=fast", "bf16@lr=-1e-5", "bf17@lr=1e-5"):
        with pytest.raises(SystemExit, match="mode"):
            rx.mode_sets(bad)


def _entry(mode, seed, steps, evals, reward=0.5):
    rows = [{"step": t, "reward": reward + 0.01 * t, "k3_kl": 1e-15 if mode.startswith("trace") else 1e-3,
             "step_s": 1.0} | ({"flip_rate": 1e-3, "flip_rate_by_layer": {"0": 1e-3, "1": 2e-3},
                                "residual_flip_rate_by_layer": {"0": 0.0, "1": 0.0}} if mode != "bf16" else {})
            for t in range(steps)]
    ev = {k: {"correct": 30 + seed, "total": 50, "accuracy": (30 + seed) / 50, "lo": 0.4, "hi": 0.7, "wall_s": 1.0}
          for k in evals}
    return {"mode": mode, "seed": seed, "metrics": rows, "rl_done": True, "eval": ev, "sft_fingerprint": "ab"}


def test_merging_keeps_the_most_finished_work_and_refuses_other_settings(rx):
    s = rx.Settings(**(asdict(rx.Settings()) | rx.SMOKE))
    mine, theirs = rx.new_state(s), rx.new_state(s)
    mine["runs"]["bf16/s0"] = _entry("bf16", 0, 3, ["bf16"])  # evaluated in part
    theirs["runs"]["bf16/s0"] = _entry("bf16", 0, 3, ["bf16", "ptq-fp4"])
    theirs["runs"]["trace-all/s0"] = {"mode": "trace-all", "seed": 0, "eval": {}}  # started, not finished
    mine["runs"]["trace-all/s0"] = _entry("trace-all", 0, 3, [])
    theirs["sft"]["fingerprints"] = ["ab"]
    rx.merge_state(mine, {"state": theirs}, "report.json")  # a report's JSON carries its state
    assert set(mine["runs"]["bf16/s0"]["eval"]) == {"bf16", "ptq-fp4"} and mine["runs"]["trace-all/s0"]["rl_done"]
    assert mine["sft"]["fingerprints"] == ["ab"]
    other = rx.new_state(replace(s, rl_steps=4))
    with pytest.raises(SystemExit, match="rl_steps=4"):
        rx.merge_state(mine, other, "x.json")


def test_sft_evaluations_are_kept_per_sft_model_and_old_states_upgrade(rx):
    """A fresh machine's SFT gives another model, so its evaluation is another row. A version-1
    state kept one set of SFT evaluations: those of its first SFT model (evaluated right after it)."""
    s = rx.Settings(**(asdict(rx.Settings()) | rx.SMOKE))
    ev = {"correct": 9, "total": 10, "accuracy": 0.9, "lo": 0.6, "hi": 0.98}
    old = rx.new_state(s) | {"version": 1}
    old["sft"] = {"fingerprints": ["ab", "cd"], "wall_s": [1.0], "eval": {"bf16": ev}}
    mine = rx.new_state(s)
    mine["sft"] = {"fingerprints": ["ef"], "wall_s": [2.0], "eval": {"ef": {"bf16": ev | {"correct": 8}}}}
    rx.merge_state(mine, old, "old.json")
    assert mine["sft"]["eval"] == {"ef": {"bf16": ev | {"correct": 8}}, "ab": {"bf16": ev}}
    assert mine["sft"]["fingerprints"] == ["ef", "ab", "cd"]
    assert mine["sft"]["wall_s"] == [2.0, 1.0]  # each SFT's time, once however often merged
    rx.merge_state(mine, old, "old.json")
    assert mine["sft"]["wall_s"] == [2.0, 1.0]
    with pytest.raises(SystemExit, match="state version 7"):
        rx.merge_state(mine, rx.new_state(s) | {"version": 7}, "new.json")


def test_the_report_from_a_recorded_state(rx, tmp_path):
    s = rx.Settings(**(asdict(rx.Settings()) | rx.SMOKE | {"rl_steps": 12}))
    state = rx.new_state(s)
    for seed in (0, 1):
        state["runs"][f"bf16/s{seed}"] = _entry("bf16", seed, 12, ["bf16", "ptq-fp4"])
        state["runs"][f"trace-all/s{seed}"] = _entry("trace-all", seed, 12, ["fp4-export"], reward=0.6)
    state["sft"]["eval"] = {"ab": {"bf16": {"correct": 10, "total": 50, "accuracy": 0.2, "lo": 0.1, "hi": 0.3}},
                            "zz": {"bf16": {"correct": 1, "total": 50, "accuracy": 0.02, "lo": 0.0, "hi": 0.1}}}
    state["runs"]["trace-all/s1"]["eval"]["fp4-export"] |= {"correct": 35, "accuracy": 0.7}
    cut = _entry("fp4-qat", 1, 5, [], reward=0.4)  # cut off by a session's end after 5 steps
    state["runs"]["fp4-qat/s1"] = {k: v for k, v in cut.items() if k not in ("metrics", "rl_done")} | {
        "partial_metrics": cut["metrics"]}
    (tmp_path / "state.json").write_text(json.dumps(state))
    rc = rx.main(["--smoke", "--report-only", "--rl-steps", "12", "--runs", str(tmp_path), "--out", str(tmp_path),
                  "--modes", "bf16,trace-all,fp4-qat", "--seeds", "0,1"])
    assert rc == rx.STOPPED  # fp4-qat is missing
    md = next(tmp_path.glob("rl_experiment_*.md")).read_text()
    assert "| trace-all | 2 | 0.625 (0.625-0.625) | 0.685 (0.685-0.685) |" in md  # mean of the first / last 6 steps
    assert "| trace-all | trace-export-fp4 -> FP4 engine | 0.600 [0.400, 0.700] | 0.700 [0.400, 0.700] |" in md
    # both seeds' runs started from SFT model "ab": its row, counted once ("zz" trained no run here)
    assert ("| SFT model (before RL) | BF16 (HF) -> BF16 engine | 0.200 [0.100, 0.300] | 0.200 [0.100, 0.300] "
            "| 0.200 (1 model) | 10/50 |") in md and "seeds 0, 1 `ab`" in md
    # paired with the same seed's PTQ of bf16 (30/50, 31/50): 0.600 - 0.600, 0.700 - 0.620
    assert "| trace-all | trace-export-fp4 -> FP4 engine | 0, 1 | +0.000, +0.080 | +0.040 |" in md
    # how far the cut-off run got: its 5 steps, 1 s each, reward over its first / last 2 steps
    assert ("Not finished: fp4-qat/s1 (5/12 steps, 1.0 s/step, reward 0.405 -> 0.435, "
            "k3_kl 1.00e-03).") in md and "**Incomplete**" in md
    assert "Not run: fp4-qat/s0." in md  # never started: not in the state
    report = json.loads(next(tmp_path.glob("rl_experiment_*.json")).read_text())
    assert report["summary"]["bf16"]["eval"]["ptq-fp4"]["pooled"] == pytest.approx(61 / 100)
    assert report["state"]["runs"].keys() == state["runs"].keys()  # resumable from the report
    assert next(tmp_path.glob("rl_experiment_*.png")).stat().st_size > 10_000
    # a report of some seeds averages over those only
    rx.main(["--smoke", "--report-only", "--rl-steps", "12", "--runs", str(tmp_path), "--out", str(tmp_path / "s1"),
             "--modes", "bf16,trace-all", "--seeds", "1"])
    md = next((tmp_path / "s1").glob("rl_experiment_*.md")).read_text()
    assert "| trace-all | 1 | 0.625 | 0.685 |" in md  # one run, not two
    assert "| trace-all | trace-export-fp4 -> FP4 engine | 0.700 [0.400, 0.700] | 0.700 |" in md  # not 0.650


def test_a_seed_is_never_trained_from_two_sft_models(rx, tmp_path):
    """On a fresh machine the SFT model differs; a mode of a seed whose other runs started from
    another SFT model is not trained there (nor retrained for an evaluation whose checkpoint is
    gone), with the reason: the modes of a seed are compared from one model."""
    import argparse

    s = rx.Settings(**(asdict(rx.Settings()) | rx.SMOKE))
    args = argparse.Namespace(runs=str(tmp_path / "runs"), state=None, resume_from=[], time_limit=None, reserve=45,
                              verbose=False)
    exp = rx.Experiment(args, s)
    exp.state["runs"]["bf16/s0"] = _entry("bf16", 0, 3, ["bf16", "ptq-fp4"]) | {"sft_fingerprint": "aa"}
    exp.state["runs"]["trace-all/s0"] = _entry("trace-all", 0, 3, []) | {"sft_fingerprint": "aa"}  # not evaluated
    exp.sft_fingerprint = "bb"
    why = exp.sft_conflict("fp4-qat", 0)
    assert "fp4-qat seed 0" in why and "SFT model aa" in why and "bb" in why
    assert "trace-all seed 0" in exp.sft_conflict("trace-all", 0)  # its checkpoint is gone: retraining would mix
    assert exp.sft_conflict("fp4-qat", 1) is None  # a new seed
    exp.sft_fingerprint = "aa"
    assert exp.sft_conflict("fp4-qat", 0) is None


def test_a_failing_evaluation_is_a_runtime_error_naming_the_model(rx, tmp_path):
    """Any error of an evaluation (here an HF directory whose config.json is empty, met when the
    engine is built) reaches the experiment as a RuntimeError naming the model and the kind, with
    its process's traceback: the experiment records it and its trainers go on (a MemoryError of
    the calibration engine once ended a whole session's runs)."""
    import argparse
    import re

    s = rx.Settings(**(asdict(rx.Settings()) | rx.SMOKE))
    args = argparse.Namespace(runs=str(tmp_path / "runs"), state=None, resume_from=[], time_limit=None, reserve=45,
                              verbose=False)
    exp = rx.Experiment(args, s)
    work = tmp_path / "work"
    (work / "hf").mkdir(parents=True)
    (work / "hf" / "config.json").write_text("{}")  # converted already, as the experiment sees it
    model = tmp_path / "model"
    with pytest.raises(RuntimeError, match=rf"evaluating {re.escape(str(model))} as bf16 failed \(exit 1\)") as e:
        exp.evaluate("bf16", model, work)
    assert "Traceback" in str(e.value) and re.search(r"\w+Error", str(e.value))


def test_the_smoke_experiment_trains_and_evaluates_every_run(tmp_path):
    """`--smoke` end to end (about a minute on 2 cores): SFT, two modes trained two at once, each
    run then evaluated in processes of its own beside the other's training, the SFT model
    evaluated too; the report written."""
    import subprocess

    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rl_experiment.py"), "--smoke", "--runs", str(runs),
                           "--parallel", "2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((runs / "state.json").read_text())
    assert {k: sorted(v["eval"]) for k, v in state["runs"].items()} == {
        "bf16/s0": ["bf16", "ptq-fp4"], "trace-all/s0": ["fp4-export"]}
    assert all(v["rl_done"] and len(v["metrics"]) == 3 for v in state["runs"].values())
    assert {fp: sorted(v) for fp, v in state["sft"]["eval"].items()} == {
        state["runs"]["bf16/s0"]["sft_fingerprint"]: ["bf16", "ptq-fp4"]}
    sft_evals = [e for v in state["sft"]["eval"].values() for e in v.values()]
    for ev in [e for v in state["runs"].values() for e in v["eval"].values()] + sft_evals:
        assert ev["total"] == 16 and 0 <= ev["correct"] <= 16 and ev["wall_s"] > 0
    assert next((runs / "report").glob("rl_experiment_*_cpu.md")).read_text().count("seed 0") >= 1
