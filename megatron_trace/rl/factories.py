"""What a run is built from, each from its configuration section: the model's architecture, the
task and the engine's settings (the trainer: `rl.trainer.build_trainer`)."""

from __future__ import annotations

from ..checkpoint.dist import read_config
from ..checkpoint.hf import HFCheckpoint
from ..config import ModelSection, RLSection, TaskSection
from ..guidance import Coding
from ..model_config import PRESETS, ModelConfig
from ..modes import RunMode
from .rewards import load_reward
from .tasks import ArithmeticTask, ChainTask, CharTokenizer, HFTokenizer, JsonlTask


def resolve_model_config(model: ModelSection) -> ModelConfig:
    """The model's architecture: from model.hf's config.json, model.megatron's checkpoint, else
    the preset (ValueError for one that TRACE does not build yet)."""
    if model.hf:
        return HFCheckpoint(model.hf).model_cfg
    if model.megatron:
        return read_config(model.megatron)
    if PRESETS[model.preset].unbuilt:
        raise ValueError(f"model.preset {model.preset} is for trace-rl plan only (the DeepSpeed trainer lacks its "
                         f"{PRESETS[model.preset].unbuilt}; train the family from model.hf)")
    return PRESETS[model.preset]


def make_task(task: TaskSection, seed: int):
    """The task the section describes (see rl.tasks)."""
    if task.kind == "arithmetic":
        return ArithmeticTask(task.digits, task.ops, seed=seed)
    if task.kind == "chain":
        return ChainTask(task.digits, task.ops, task.terms, seed=seed)
    tokenizer = CharTokenizer() if task.tokenizer == "char" else HFTokenizer(task.tokenizer)
    return JsonlTask(task.path, tokenizer, load_reward(task.reward), seed=seed)


def engine_settings(rl: RLSection, guide: str | None = None) -> tuple:
    """(EnginePrecision, guidance policy, Coding): what the engine runs and records for the run's
    mode (`guide` overrides rl.guide, e.g. with what a budget resolved to). fp4-qat records dense
    guidance it does not apply, to measure flips (rl.measure_flips)."""
    measure = rl.measure_flips and rl.mode is RunMode.FP4_QAT
    if rl.mode.applies_guidance:
        return rl.mode.engine_precision, guide or rl.guide, rl.coding
    return rl.mode.engine_precision, "all" if measure else "none", Coding.DENSE
