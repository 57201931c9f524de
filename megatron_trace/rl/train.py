"""`trace-rl train`: supervised warm-up, then GRPO with FP4 TRACE rollouts, end to end.

With no settings: the embedded default (arithmetic task, `demo` model) in one process with the
built-in engine; under torchrun (`dist.engine_ranks`) trainer ranks and engine ranks. The run
reads as its phases: start (build or resume), SFT, RL setup, RL steps. Metrics go to JSON lines
and TensorBoard, checkpoints to resume from (`rl.run_checkpoint`). The configuration is
`megatron_trace.config.TrainConfig`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RESUMABLE, RLSection, TrainConfig, flat_config
from ..model_config import ModelConfig
from ..rollout import SamplingParams, close_backend
from .budget import resolve_budget
from .factories import engine_settings, make_task
from .ranks import distributed_trainer, is_rank0
from .report import MetricsLog, plot_report
from .run_checkpoint import RunState, latest_checkpoint, load_checkpoint, save_checkpoint
from .sft import sft_step, with_near_misses
from .step import rl_step
from .trainer import Trainer, build_trainer
from .weight_sync import sync_weights


@dataclass(kw_only=True)
class Run:
    """What the phases share: the configuration, the trainer, the task and where the run stands
    (`state`; `saved`: the checkpoint it resumed from, until its optimizer state is restored)."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    out_dir: Path
    trainer: Trainer
    task: object
    state: RunState
    saved: dict | None
    progress: bool

    def checkpoint(self, phase: str, step: int, weight_version: int) -> None:
        """Write a checkpoint of the run at `phase` / `step` (see rl.run_checkpoint)."""
        save_checkpoint(self.out_dir, self.trainer, self.task.state_dict(),
                        RunState(phase=phase, step=step, weight_version=weight_version, guide=self.state.guide),
                        flat_config(self.cfg), self.cfg.checkpoint.keep)

    def start_phase(self, lr: float) -> None:
        """A fresh optimizer state for a new phase at learning rate `lr`, restored from the
        checkpoint when the run resumed inside this phase."""
        self.trainer.start_phase(lr)
        if self.saved is not None:
            self.trainer.load_optimizer(self.saved["path"])


def train(cfg: TrainConfig, make_engine, model_cfg: ModelConfig, progress: bool = True) -> list[dict]:
    """Warm-up, then RL; every RL step's metrics go to output_dir/metrics.jsonl and TensorBoard.
    Checkpoints as `checkpoint` says; with checkpoint.resume a killed run continues from the
    latest one as it would have. make_engine(precision, guide, coding) -> a RolloutBackend.
    Returns the metrics of every RL step of the run (on trainer rank 0; [] elsewhere)."""
    run = start(cfg, model_cfg, progress)
    run_sft(run)
    if run.state.phase == "sft":
        run.state, run.saved = RunState(phase="rl"), None
    run.start_phase(cfg.rl.lr)
    if run.saved is None and cfg.sft.steps:
        run.checkpoint("rl", 0, 0)  # the warmed-up model: RL restarts never redo the warm-up
    if run.state.step >= cfg.rl.steps:  # nothing left to do (e.g. `trace-rl sft`)
        return []
    return run_rl(run, make_engine)


def start(cfg: TrainConfig, model_cfg: ModelConfig, progress: bool) -> Run:
    """The trainer and the task, from their sections, or as the latest checkpoint left them."""
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(cfg.task, cfg.seed)
    if task.tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the task's tokenizer needs {task.tokenizer.vocab_size} ids, "
                         f"the model has {model_cfg.vocab_size}")
    if cfg.dist.engine_tp != 1 and cfg.rollout.backend == "builtin":
        raise ValueError("dist.engine_tp: the built-in engine runs on one GPU; rollout.backend=sglang shards an "
                         "engine over dist.engine_tp GPUs")
    trainer = build_trainer(cfg, model_cfg)
    run = Run(cfg=cfg, model_cfg=model_cfg, out_dir=out_dir, trainer=trainer, task=task, state=RunState(), saved=None,
              progress=progress and is_rank0())
    ckpt = latest_checkpoint(out_dir) if cfg.checkpoint.resume else None
    if ckpt is not None:
        run.saved = load_checkpoint(ckpt, trainer, flat_config(cfg), RESUMABLE)
        run.state = RunState(**run.saved["state"])
        task.load_state_dict(run.saved["task"])
        torch.set_rng_state(run.saved["torch_rng"])
        if is_rank0():
            print(f"resuming from {ckpt} ({run.state.phase} step {run.state.step})")
    return run


def run_sft(run: Run) -> None:
    """The supervised warm-up's remaining steps (none once the run is in RL)."""
    cfg, state = run.cfg, run.state
    if state.phase != "sft" or state.step >= cfg.sft.steps:
        return
    run.start_phase(cfg.sft.lr)
    bar = tqdm(range(state.step, cfg.sft.steps), desc="sft", disable=not run.progress, initial=state.step,
               total=cfg.sft.steps)
    for i in bar:
        problems = with_near_misses(run.task.problems(cfg.sft.batch), cfg.sft.label_noise)
        loss = sft_step(run.trainer, [run.task.sft_example(p) for p in problems])
        bar.set_postfix(loss=f"{loss:.3f}")
        if cfg.checkpoint.sft_every and (i + 1) % cfg.checkpoint.sft_every == 0 and i + 1 < cfg.sft.steps:
            run.checkpoint("sft", i + 1, 0)


def run_rl(run: Run, make_engine) -> list[dict]:
    """RL setup (a budget's layers resolved, the engine built and given the weights, the KL
    reference, the metrics log), then the RL steps; returns their metrics."""
    cfg, state = run.cfg, run.state
    if cfg.rl.mode.applies_guidance and cfg.rl.guide.startswith("budget:") and not state.guide:
        state.guide = _resolve_budget(run, make_engine)
    engine = make_engine(*engine_settings(cfg.rl, state.guide))
    try:
        return _rl_steps(run, engine)
    finally:  # the SGLang backend's processes end with the run, whatever ended it
        close_backend(engine)


def _rl_steps(run: Run, engine) -> list[dict]:
    cfg, state = run.cfg, run.state
    sync_weights(run.trainer, engine, state.weight_version, cfg.dist.sync_bucket_mb)
    reference = run.trainer.reference(run.out_dir / "checkpoints" / "reference",
                                      resumed=run.saved is not None) if cfg.rl.kl_coef else None
    log = MetricsLog(run.out_dir, state.step) if is_rank0() else None
    prompts = _PromptSource(run.task, cfg.rl, cfg.seed)
    history = []
    bar = tqdm(range(state.step, cfg.rl.steps), desc=f"rl ({cfg.rl.mode})", disable=not run.progress,
               initial=state.step, total=cfg.rl.steps)
    for step in bar:
        prompts.start(step)
        t0 = time.perf_counter()
        m = rl_step(run.trainer, engine, prompts.draw(cfg.rl.prompts_per_step), prompts.reward, cfg.rl,
                    _sampling(cfg, run.task, cfg.seed * 100_003 + step), step, more_prompts=prompts.draw,
                    reference=reference, sync_bucket_mb=cfg.dist.sync_bucket_mb)
        m["step_s"] = time.perf_counter() - t0
        if distributed_trainer():
            from .disaggregated import average_metrics

            m = average_metrics(m)
        if log is not None:
            log.write(m)
        history.append(m)
        bar.set_postfix(reward=f"{m['reward']:.2f}", k3=f"{m.get('k3_kl', float('nan')):.1e}")
        if (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or step + 1 == cfg.rl.steps:
            run.checkpoint("rl", step + 1, engine.weight_version)
    if log is None:  # not trainer rank 0: it reports
        return []
    log.close()
    if log.history:
        plot_report(log.history, run.out_dir / "report.png", f"{cfg.model.preset}, {cfg.rl.mode} mode")
    return history


class _PromptSource:
    """The RL prompts as token ids, remembering each one's problem for its reward (within a step).

    With rl.prompt_set = N the prompts come from N problems drawn once when RL starts (the task's
    draw state is left as it was, so a resumed run draws the same ones), gone through in epochs,
    each in its own seeded order; a step's rounds take consecutive places of that stream,
    `rl.max_rounds` x `rl.prompts_per_step` of them reserved per step, so a step's prompts follow
    from its number alone. With 0, fresh problems from the task every step."""

    def __init__(self, task, rl: RLSection, seed: int):
        self.task, self.max_prompt_tokens, self.seed, self.by_prompt = task, rl.max_prompt_tokens, seed, {}
        self.pool = None
        if rl.prompt_set:
            snapshot = task.state_dict()
            self.pool = task.problems(rl.prompt_set)
            task.load_state_dict(snapshot)
        self.per_step = rl.prompts_per_step * (rl.max_rounds if rl.dynamic_sampling else 1)
        self.cursor = 0

    def start(self, step: int) -> None:
        """A new step: forget the last step's prompts; the pool's stream moves to this step's places."""
        self.by_prompt.clear()
        self.cursor = step * self.per_step

    def _problems(self, n: int) -> list:
        if self.pool is None:
            return self.task.problems(n)
        out = []
        for place in range(self.cursor, self.cursor + n):
            epoch, i = divmod(place, len(self.pool))
            order = list(range(len(self.pool)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            out.append(self.pool[order[i]])
        self.cursor += n
        return out

    def draw(self, n: int) -> list[tuple[int, ...]]:
        problems = self._problems(n)
        prompts = [tuple(self.task.prompt_ids(p)) for p in problems]
        longest = max(map(len, prompts), default=0)
        if longest > self.max_prompt_tokens:
            raise ValueError(f"a prompt of {longest} tokens exceeds rl.max_prompt_tokens={self.max_prompt_tokens}")
        self.by_prompt.update(zip(prompts, problems, strict=True))
        return prompts

    def reward(self, prompt, response) -> float:
        return self.task.reward(self.by_prompt[tuple(prompt)], response)


def _sampling(cfg: TrainConfig, task, seed: int) -> SamplingParams:
    return SamplingParams(temperature=cfg.rl.temperature, max_new_tokens=cfg.rl.max_new_tokens,
                          stop_token_ids=(task.tokenizer.eos_id,), seed=seed)


def _resolve_budget(run: Run, make_engine) -> str:
    """Measure flips and guidance cost per layer on one calibration rollout (prompts drawn without
    moving the task's draw state) and resolve rl.guide's budget to a layer list."""
    cfg, task = run.cfg, run.task
    snapshot = task.state_dict()
    prompts = [tuple(task.prompt_ids(p)) for p in task.problems(cfg.rl.prompts_per_step)]
    task.load_state_dict(snapshot)
    guide, flips, cost = resolve_budget(cfg.rl, run.trainer, make_engine, prompts,
                                        _sampling(cfg, task, cfg.seed * 100_003 - 1), run.model_cfg.num_layers,
                                        cfg.dist.sync_bucket_mb)
    if is_rank0():
        print(f"{cfg.rl.guide}: guiding {guide} (flip rate by layer {', '.join(f'{v:.2%}' for v in flips.values())}; "
              f"bytes per token {', '.join(f'{v:.0f}' for v in cost.values())})")
    return guide
