"""The configuration schema: defaults that run, errors that name the key, the generated
reference, and old checkpoints read in today's vocabulary."""

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from megatron_trace import config
from megatron_trace.cli import main
from megatron_trace.config import RLSection, TrainConfig, flat_config, load_config, upgrade_flat_config
from megatron_trace.modes import RunMode

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_yaml_and_overrides_combine(tmp_path):
    cfg = load_config()
    assert cfg == TrainConfig() and cfg.rl.mode is RunMode.TRACE and cfg.model.preset == "demo"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("rl:\n  steps: 3\n  correction: tis\n  mode: fp4-rollout\nsft:\n  lr: 0.01\nseed: 4\n")
    cfg = load_config(str(yaml_file), ["rl.group_size=8", "task.ops=+-", "rl.dynamic_sampling=yes"])
    assert (cfg.rl.steps, cfg.rl.correction, cfg.sft.lr, cfg.rl.group_size, cfg.task.ops, cfg.seed) == \
        (3, "tis", 0.01, 8, "+-", 4)
    assert cfg.rl.mode is RunMode.FP4_ROLLOUT and cfg.rl.dynamic_sampling is True
    assert isinstance(cfg.sft.lr, float) and isinstance(cfg.rl.steps, int)


@pytest.mark.parametrize("override, message", [
    ("rl.stepz=3", "unknown key 'rl.stepz'"), ("rll.steps=3", "unknown section 'rll'"),
    ("rl.steps=many", "rl.steps must be an int, got 'many'"), ("rl.steps=2.5", "rl.steps must be an int"),
    ("rl.mode=fp8", "rl.mode: 'fp8' is not a valid RunMode"), ("rl.mode=fp4", "'fp4' is now fp4-rollout"),
    ("rl.precision=trace", "rl.precision was renamed rl.mode"), ("rl.correction=clip", "rl.correction must be one of"),
    ("rl.coding=sparse2", "rl.coding"), ("rl.dynamic_sampling=maybe", "rl.dynamic_sampling must be true or false"),
    ("model.preset=huge", "model.preset"), ("rl.group_size=1", "rl.group_size must be >= 2"),
    ("rl.guide=deep:x", "rl.guide: bad guidance layer policy"), ("cluster.engine_nodes=1", "cluster.engine_nodes"),
    ("rl.steps", "section.key=value"), ("rl=3", "rl is a section"), ("colour=red", "unknown key 'colour'"),
    ("engine=sglang_rollout.engine:TraceEngine", "engine was renamed rollout.backend"),
    ("rollout.backend=vllm", "rollout.backend must be one of builtin, sglang or a dotted path"),
    ("rollout.sglang={mem_fraction_static: 0.5}", "rollout.sglang must be empty unless rollout.backend is sglang"),
    ("model.hf=/nowhere", "model.hf must be an HF checkpoint directory"),
    ("trainer.transformer_impl=te", r"trainer.transformer_impl must be one of \['local', 'transformer_engine'\]"),
    ("trainer.megatron={cross_entropy_fusion: true}",
     r"trainer.megatron has keys that are not Megatron TransformerConfig fields: \['cross_entropy_fusion'\]"),
])
def test_a_bad_setting_is_an_error_that_names_it(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def _configs_with(rank, options):
    """In a process with Megatron's parallel state: the TransformerConfig's loss fusion settings
    with and without `options`, and the error of an option TRACE sets itself."""
    from megatron_trace.megatron.model import transformer_config
    from megatron_trace.model_config import PRESETS

    tc, default = transformer_config(PRESETS["tiny"], megatron_options=options), transformer_config(PRESETS["tiny"])
    try:
        transformer_config(PRESETS["tiny"], megatron_options={**options, "num_layers": 3})
        error = None
    except ValueError as e:
        error = str(e)
    return dict(fusion=(tc.cross_entropy_loss_fusion, tc.cross_entropy_fusion_impl),
                default=default.cross_entropy_loss_fusion, error=error)


def test_megatrons_own_settings_pass_through_to_its_transformer_config():
    """`trainer.megatron` reaches the model's TransformerConfig; a field TRACE sets itself is
    refused naming it; DeepSpeed runs refuse the section."""
    from megatron_trace.megatron.spawn import spawn

    cfg = load_config(None, ["trainer.megatron={cross_entropy_loss_fusion: true, cross_entropy_fusion_impl: native}"])
    assert cfg.trainer.megatron == {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}
    (r,) = spawn(_configs_with, {}, options=cfg.trainer.megatron)
    assert r["fusion"] == (True, "native") and r["default"] is False  # Megatron's default: unfused
    assert "trainer.megatron sets ['num_layers'], which TRACE sets" in r["error"]
    with pytest.raises(ValueError, match="trainer.megatron must be empty unless trainer.backend is megatron"):
        load_config(None, ["trainer.backend=deepspeed", "trainer.megatron={cross_entropy_loss_fusion: true}"])


def test_transformer_engine_layers_are_megatrons_and_need_a_gpu():
    with pytest.raises(ValueError, match="trainer.transformer_impl must be local with trainer.backend=deepspeed"):
        load_config(None, ["trainer.backend=deepspeed", "trainer.transformer_impl=transformer_engine"])
    from megatron_trace.megatron.trainer import linears_for

    assert linears_for("local").name == "local"
    with pytest.raises(ValueError, match="'local' or 'transformer_engine', got 'te'"):
        linears_for("te")
    import torch

    if not torch.cuda.is_available():  # TE's modules refuse the CPU: said before any model is built
        with pytest.raises(RuntimeError, match="transformer_impl=transformer_engine needs a GPU"):
            linears_for("transformer_engine")


def test_yaml_values_of_the_wrong_type_are_refused_not_converted(tmp_path):
    for text, message in (("rl:\n  temprature: 0.5\n", "unknown key 'rl.temprature'"),
                          ("cluster:\n  time: 24:00:00\n", "cluster.time must be a string, got int 86400"),
                          ("rl:\n  steps: true\n", "rl.steps must be an int, got True"),
                          ("- a list\n", "must hold a mapping")):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_config(str(path))


def test_sections_check_when_built_in_python_too():
    assert RLSection(mode="fp4-qat", group_size=3).mode is RunMode.FP4_QAT
    with pytest.raises(ValueError, match="rl.kl_coef must be >= 0"):
        RLSection(kl_coef=-1.0)
    with pytest.raises(TypeError):  # keyword-only: no positional misreading
        RLSection(40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().rl.steps = 3


def test_every_field_is_documented_and_typed():
    for cls in (*config.SECTIONS.values(), TrainConfig):
        docs, hints = config.field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in config.SECTIONS:
                continue
            assert len(docs.get(f.name, "")) > 10, f"{cls.__name__}.{f.name} has no docstring"
            tp = hints[f.name]
            assert tp in (int, float, bool, str, dict) or typing.get_origin(tp) is typing.Literal \
                or issubclass(tp, config.enum.Enum), f"{cls.__name__}.{f.name}: {tp}"


def test_the_reference_in_docs_is_the_schemas():
    """docs/configuration.md is generated: `trace-rl config --reference > docs/configuration.md`."""
    generated = config.reference_markdown()
    assert (ROOT / "docs" / "configuration.md").read_text() == generated
    for name, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"`{name}.{f.name}`" in generated


def test_the_printed_config_loads_back_to_the_same_run(tmp_path, capsys):
    main(["config", "--set", "rl.mode=fp4-qat", "--set", "cluster.partition=gpu"])
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(str(path)) == load_config(None, ["rl.mode=fp4-qat", "cluster.partition=gpu"])


@pytest.mark.parametrize("path", sorted((ROOT / "launch" / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_example_configs_load(path):
    cfg = load_config(str(path))
    assert yaml.safe_load(path.read_text())["model"]["preset"] == cfg.model.preset


def test_a_checkpoint_written_before_the_renames_reads_in_todays_names():
    old = {k: v for k, v in flat_config(TrainConfig()).items() if k not in ("rl.mode", "rl.correction_threshold")}
    old["rl.precision"] = "fp4"
    upgraded = upgrade_flat_config(old)
    assert upgraded == flat_config(load_config(None, ["rl.mode=fp4-rollout"]))


def test_megatrons_own_optimizer_options_pass_through_and_are_checked():
    """optim.megatron reaches Megatron's OptimizerConfig / DistributedDataParallelConfig as given;
    a field neither has is refused by name at start."""
    from megatron_trace.megatron.optimizer import _split_passthrough

    cfg = load_config(None, ["optim.megatron={adam_beta2: 0.95, bucket_size: 1000}"])
    assert cfg.optim.megatron == {"adam_beta2": 0.95, "bucket_size": 1000}
    assert _split_passthrough(cfg.optim.megatron) == ({"adam_beta2": 0.95}, {"bucket_size": 1000})
    with pytest.raises(ValueError, match=r"optim.megatron: \['adam_beta3'\]"):
        _split_passthrough({"adam_beta3": 0.9})
    with pytest.raises(ValueError, match="optim.megatron must be a mapping"):
        load_config(None, ["optim.megatron=3"])
    with pytest.raises(ValueError, match="optim.cpu_offload"):
        load_config(None, ["optim.distributed=false", "optim.cpu_offload=true"])


def test_tiny_yaml_spells_out_the_embedded_default():
    """launch/configs/tiny.yaml is the defaults written out (its cluster is one GPU, the default eight)."""
    tiny = load_config(ROOT / "launch" / "configs" / "tiny.yaml")
    assert dataclasses.replace(tiny, cluster=load_config().cluster) == load_config()
