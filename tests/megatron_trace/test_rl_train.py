"""`trace-rl train`: the configuration schema and a short end-to-end run."""

import json

import pytest

from megatron_trace.megatron.spawn import spawn
from megatron_trace.rl.train import load_config


def test_config_defaults_run_and_bad_keys_are_named(tmp_path):
    cfg = load_config()
    assert cfg.rl.precision == "trace" and cfg.model.preset == "demo"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("rl:\n  steps: 3\n  correction: tis\nsft:\n  lr: 0.01\n")
    cfg = load_config(str(yaml_file), ["rl.group_size=8", "task.ops=+-"])
    assert (cfg.rl.steps, cfg.rl.correction, cfg.sft.lr, cfg.rl.group_size, cfg.task.ops) == (3, "tis", 0.01, 8, "+-")
    for override, message in (("rl.stepz=3", "unknown key 'rl.stepz'"), ("rll.steps=3", "unknown section 'rll'"),
                              ("rl.steps=many", "rl.steps must be a int"), ("rl.precision=fp8", "rl.precision must be"),
                              ("rl.correction=clip", "rl.correction must be"), ("model.preset=huge", "model.preset"),
                              ("rl.steps", "section.key=value")):
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("rl:\n  temprature: 0.5\n")
    with pytest.raises(ValueError, match="unknown key 'rl.temprature'"):
        load_config(str(bad_yaml))


def run_train(rank, *, out_dir, precision):
    from megatron_trace.cli import main

    main(["train", "--set", "sft.steps=20", "--set", "rl.steps=2", "--set", "rl.prompts_per_step=4",
          "--set", f"rl.precision={precision}", "--set", f"output_dir={out_dir}"])


@pytest.mark.parametrize("precision", ["bf16", "trace"])
def test_a_short_run_writes_its_metrics(tmp_path, precision):
    spawn(run_train, {}, out_dir=str(tmp_path), precision=precision)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 <= r["reward"] <= 1 and r["weight_sync_bytes"] > 0 and r["step_s"] > 0
    if precision == "trace":  # the guided trainer forward follows the engine
        assert all(r["k3_kl"] < 1e-9 for r in rows)
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
