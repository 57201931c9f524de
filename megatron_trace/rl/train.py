"""`trace-rl train`: the embedded default, end to end on one process.

Supervised warm-up on the arithmetic task, then GRPO with FP4 TRACE rollouts from the built-in
engine (colocated), metrics as JSON lines. Configuration is one typed schema (`TrainConfig`),
read from YAML and `--set section.key=value` overrides, checked at start: an unknown key or a
bad value is an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model_config import ModelConfig
from ..rollout import SamplingParams
from .optim import MasterAdamW
from .report import plot_report
from .step import StepConfig, rl_step, sync_weights


@dataclass
class ModelSection:
    preset: str = "demo"  # a key of model_config.PRESETS


@dataclass
class TaskSection:
    digits: int = 2
    ops: str = "+"


@dataclass
class SFTSection:
    steps: int = 1000
    batch: int = 64
    lr: float = 3e-3


@dataclass
class RLSection:
    steps: int = 40
    prompts_per_step: int = 32
    group_size: int = 4
    max_new_tokens: int = 5
    temperature: float = 1.0
    lr: float = 3e-4
    precision: str = "trace"  # bf16, fp4, fp4-qat, trace
    guide: str = "all"
    coding: str = "dense"
    correction: str = "none"  # none, tis, mis
    clip_low: float = 0.2
    clip_high: float = 0.28


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    engine: str = "sglang_rollout.engine:TraceEngine"
    output_dir: str = "runs/default"
    seed: int = 0

    def validate(self) -> None:
        from ..model_config import PRESETS
        from .losses import CORRECTIONS
        from .mismatch import MODES

        checks = [
            (self.model.preset in PRESETS, "model.preset", f"one of {sorted(PRESETS)}"),
            (self.rl.precision in MODES, "rl.precision", f"one of {MODES}"),
            (self.rl.correction in CORRECTIONS, "rl.correction", f"one of {CORRECTIONS}"),
            (self.rl.coding in ("dense", "sparse"), "rl.coding", "dense or sparse"),
            (self.rl.group_size >= 2, "rl.group_size", ">= 2 (GRPO normalises within groups)"),
            (self.task.digits >= 1, "task.digits", ">= 1"),
            (self.sft.steps >= 0 and self.rl.steps >= 0, "sft.steps / rl.steps", ">= 0"),
        ]
        for ok, key, want in checks:
            if not ok:
                raise ValueError(f"config: {key} must be {want}")
        from ..guidance import LayerPolicy
        LayerPolicy.parse(self.rl.guide)


def _set(obj, dotted: str, raw: str) -> None:
    *path, last = dotted.split(".")
    for p in path:
        if not dataclasses.is_dataclass(obj) or p not in {f.name for f in dataclasses.fields(obj)}:
            raise ValueError(f"config: unknown section {p!r} in {dotted!r}")
        obj = getattr(obj, p)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if last not in fields or dataclasses.is_dataclass(getattr(obj, last)):
        raise ValueError(f"config: unknown key {dotted!r}")
    current = getattr(obj, last)
    try:
        value = type(current)(raw) if not isinstance(raw, type(current)) else raw
    except ValueError:
        raise ValueError(f"config: {dotted} must be a {type(current).__name__}, got {raw!r}") from None
    setattr(obj, last, value)


def load_config(path: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then a YAML file ({section: {key: value}}), then "section.key=value" overrides."""
    cfg = TrainConfig()
    if path:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}

        def walk(prefix, d):
            for k, v in d.items():
                key = f"{prefix}{k}"
                if isinstance(v, dict):
                    walk(key + ".", v)
                else:
                    _set(cfg, key, v)
        walk("", data)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config override {item!r} must be section.key=value")
        _set(cfg, key.strip(), value.strip())
    cfg.validate()
    return cfg


def train(cfg: TrainConfig, make_engine, model_cfg: ModelConfig, progress: bool = True) -> list[dict]:
    """Warm-up, then RL; metrics of every RL step are appended to output_dir/metrics.jsonl."""
    from tqdm import tqdm

    from ..megatron.model import build_model
    from .sft import sft_step
    from .tasks import ArithmeticTask

    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = ArithmeticTask(cfg.task.digits, cfg.task.ops, seed=cfg.seed)
    if task.tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the task's tokenizer needs {task.tokenizer.vocab_size} ids, the model has {model_cfg.vocab_size}")
    trainer = build_model(model_cfg, "bf16", grouped_gemm=True)  # BF16 compute, as the engine
    opt = MasterAdamW(trainer.parameters(), lr=cfg.sft.lr, weight_decay=0.0)
    bar = tqdm(range(cfg.sft.steps), desc="sft", disable=not progress)
    for _ in bar:
        loss = sft_step(trainer, opt, [task.sft_example(p) for p in task.problems(cfg.sft.batch)])
        bar.set_postfix(loss=f"{loss:.3f}")
    engine = make_engine("bf16" if cfg.rl.precision == "bf16" else "fp4",
                         cfg.rl.guide if cfg.rl.precision == "trace" else "none", cfg.rl.coding)
    sync_weights(trainer, engine, 0)
    opt = MasterAdamW(trainer.parameters(), lr=cfg.rl.lr, weight_decay=0.0)
    step_cfg = StepConfig(cfg.rl.precision, cfg.rl.group_size, cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.correction)
    history = []
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.write_text("")  # a new run (resuming is not implemented yet): no rows of an old one
    bar = tqdm(range(cfg.rl.steps), desc=f"rl ({cfg.rl.precision})", disable=not progress)
    for step in bar:
        problems = task.problems(cfg.rl.prompts_per_step)
        by_prompt = {tuple(task.prompt_ids(p)): p for p in problems}
        t0 = time.perf_counter()
        m = rl_step(trainer, opt, engine, list(by_prompt), lambda prompt, resp: task.reward(by_prompt[tuple(prompt)], resp),
                    step_cfg, SamplingParams(temperature=cfg.rl.temperature, max_new_tokens=cfg.rl.max_new_tokens,
                                             stop_token_ids=(2,), seed=cfg.seed * 100_003 + step), step)
        m["step_s"] = time.perf_counter() - t0
        history.append(m)
        with metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        bar.set_postfix(reward=f"{m['reward']:.2f}", k3=f"{m['k3_kl']:.1e}")
    if history:
        plot_report(history, out_dir / "report.png", f"{cfg.model.preset}, {cfg.rl.precision} mode")
    return history
