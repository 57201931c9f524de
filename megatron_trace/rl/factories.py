"""What a run is built from, each from its configuration section: the model's architecture, the
task, the optimizer, the frozen KL reference and the engine's settings."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..checkpoint.dist import load_model, read_config, save_model
from ..checkpoint.hf import HFCheckpoint
from ..config import ModelSection, OptimSection, RLSection, TaskSection
from ..guidance import Coding
from ..model_config import PRESETS, ModelConfig
from ..modes import RunMode
from .architecture import PLAN_ONLY
from .ranks import is_rank0
from .rewards import load_reward
from .tasks import ArithmeticTask, ChainTask, CharTokenizer, HFTokenizer, JsonlTask


def resolve_model_config(model: ModelSection) -> ModelConfig:
    """The model's architecture: from model.hf's config.json, model.megatron's checkpoint, else
    the preset (ValueError for a plan-only one)."""
    if model.hf:
        return HFCheckpoint(model.hf).model_cfg
    if model.megatron:
        return read_config(model.megatron)
    if model.preset not in PRESETS:
        raise ValueError(f"model.preset {model.preset} is plan-only: {PLAN_ONLY[model.preset].implemented}")
    return PRESETS[model.preset]


def make_task(task: TaskSection, seed: int):
    """The task the section describes (see rl.tasks)."""
    if task.kind == "arithmetic":
        return ArithmeticTask(task.digits, task.ops, seed=seed)
    if task.kind == "chain":
        return ChainTask(task.digits, task.ops, task.terms, seed=seed)
    tokenizer = CharTokenizer() if task.tokenizer == "char" else HFTokenizer(task.tokenizer)
    return JsonlTask(task.path, tokenizer, load_reward(task.reward), seed=seed)


def make_optimizer(trainer, lr: float, optim: OptimSection):
    """Megatron's DDP and optimizer over the trainer (`megatron.optimizer.TrainerOptimizer`)."""
    from ..megatron.optimizer import TrainerOptimizer  # here: `trace-rl plan` imports this module, not Megatron

    return TrainerOptimizer(trainer, lr, optim)


def make_reference(trainer, model_cfg: ModelConfig, path: Path, resumed: bool):
    """The frozen reference of the KL penalty: the model RL starts from, kept at `path` (a
    Megatron checkpoint) so that a resumed run penalises against the same one."""
    from ..megatron.model import build_model  # here: `trace-rl plan` imports this module, not Megatron

    reference = build_model(model_cfg, "bf16", grouped_gemm=True)
    if resumed and path.exists():
        load_model(reference, path)
    else:
        if is_rank0():
            shutil.rmtree(path, ignore_errors=True)  # of an earlier run in this output_dir
        reference.load_state_dict(trainer.state_dict())  # the same layout: the same local names
        save_model(reference, model_cfg, path)  # collective: its first step orders the removal above
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def engine_settings(rl: RLSection, guide: str | None = None) -> tuple:
    """(EnginePrecision, guidance policy, Coding): what the engine runs and records for the run's
    mode (`guide` overrides rl.guide, e.g. with what a budget resolved to). fp4-qat records dense
    guidance it does not apply, to measure flips (rl.measure_flips)."""
    measure = rl.measure_flips and rl.mode is RunMode.FP4_QAT
    if rl.mode.applies_guidance:
        return rl.mode.engine_precision, guide or rl.guide, rl.coding
    return rl.mode.engine_precision, "all" if measure else "none", Coding.DENSE
