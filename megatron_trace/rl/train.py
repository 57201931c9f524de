"""`trace-rl train`: supervised warm-up, then GRPO with FP4 TRACE rollouts, end to end.

With no settings: the embedded default (arithmetic task, `demo` model) in one process with the
built-in engine; under torchrun (`dist.engine_ranks`) trainer ranks and engine ranks. Metrics as
JSON lines and TensorBoard, checkpoints to resume from. Configuration is one typed schema (`TrainConfig`),
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
from .step import StepConfig, distributed_trainer, rl_step, sync_weights


@dataclass
class ModelSection:
    preset: str = "demo"  # a key of model_config.PRESETS (random initialisation, then SFT)
    hf: str = ""  # or an HF Qwen3-MoE checkpoint directory: its config.json and weights
    megatron: str = ""  # or a Megatron checkpoint directory (e.g. another run's checkpoints/rl-000000/model)


@dataclass
class TaskSection:
    kind: str = "arithmetic"  # arithmetic (built in) or jsonl
    digits: int = 2  # arithmetic: operand digits
    ops: str = "+"  # arithmetic: operators
    path: str = ""  # jsonl: a file of {"prompt": ..., "answer": ...}
    reward: str = "math"  # jsonl: exact, math or package.module:function(prompt, response, answer)
    tokenizer: str = "char"  # jsonl: char (the built-in alphabet) or an HF tokenizer directory


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
    max_prompt_tokens: int = 16  # a longer prompt is an error (the plan sizes KV cache and activations with it)
    max_tokens_per_microbatch: int = 0  # trainer micro-batches of at most this many tokens (0: all of a rank's at once)
    temperature: float = 1.0
    lr: float = 3e-4
    precision: str = "trace"  # bf16, fp4, fp4-qat, trace
    guide: str = "all"
    coding: str = "dense"
    correction: str = "none"  # none, tis, mis
    clip_low: float = 0.2
    clip_high: float = 0.28
    dynamic_sampling: bool = False  # DAPO: train on groups whose rewards differ, sampling more to refill
    max_rounds: int = 3  # rollout rounds per step at most (dynamic sampling)
    kl_coef: float = 0.0  # KL penalty to the reference (the model RL starts from); 0: none
    kl_kind: str = "k3"  # k1, k2 or k3 (verl's low_var_kl)
    measure_flips: bool = True  # fp4-qat: the engine also records dense guidance (not applied) to measure flips


@dataclass
class CheckpointSection:
    every: int = 10  # RL steps between checkpoints (and at the end of each phase); 0: only at the ends
    sft_every: int = 250  # SFT steps between checkpoints
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # continue from output_dir's latest checkpoint when there is one


@dataclass
class DistSection:
    engine_ranks: int = 0  # 0: colocated in one process; >0: torchrun job (launch/local.sh), the rest train
    tp: int = 1  # the trainer ranks' Megatron layout (data parallel fills the rest)
    ep: int = 1
    pp: int = 1
    etp: int = 1
    bridge: str = "auto"  # trainer <-> engine transport: auto (NCCL when every rank has its own GPU), gloo, nccl
    recompute: str = "none"  # trainer activation recompute: none, full (every layer) or selective (MoE layers)
    engine_tp: int = 1  # GPUs per engine (tensor parallel); the built-in engine runs on one (SGLang: planned)


@dataclass
class ClusterSection:
    """The machines: read by `trace-rl plan` and by the SLURM launcher (launch/slurm), never
    by the training itself, so one config file describes the run on any launcher."""

    nodes: int = 1  # SLURM nodes in all
    engine_nodes: int = 0  # of which rollout-engine nodes (disaggregated); their GPUs are dist.engine_ranks
    gpus_per_node: int = 8
    gpu_memory_gib: float = 141.0  # per GPU (H200: 141)
    host_memory_gib: float = 2000.0  # per node (trainer rank 0 gathers the full weights there for the sync)
    partition: str = ""
    account: str = ""
    time: str = "24:00:00"
    setup: str = ""  # shell run on every node before the job: module load, source venv/bin/activate ...
    container: str = ""  # container image for srun --container-image (pyxis); empty: none
    nccl_ifname: str = ""  # NCCL_SOCKET_IFNAME (e.g. ib0); empty: NCCL's choice
    gloo_ifname: str = ""  # GLOO_SOCKET_IFNAME; empty: gloo's choice
    log_dir: str = "logs"  # per-node log files of the SLURM job


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    dist: DistSection = field(default_factory=DistSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    engine: str = "sglang_rollout.engine:TraceEngine"
    output_dir: str = "runs/default"
    seed: int = 0

    def validate(self) -> None:
        from ..model_config import PRESETS
        from .losses import CORRECTIONS, KL_KINDS
        from .mismatch import MODES
        from .plan import PLAN_ONLY

        checks = [
            (self.model.preset in PRESETS or self.model.preset in PLAN_ONLY, "model.preset",
             f"one of {sorted(PRESETS)} (or, for trace-rl plan only, {sorted(PLAN_ONLY)})"),
            (self.rl.precision in MODES, "rl.precision", f"one of {MODES}"),
            (self.rl.correction in CORRECTIONS, "rl.correction", f"one of {CORRECTIONS}"),
            (self.rl.coding in ("dense", "sparse"), "rl.coding", "dense or sparse"),
            (self.rl.group_size >= 2, "rl.group_size", ">= 2 (GRPO normalises within groups)"),
            (self.rl.max_rounds >= 1, "rl.max_rounds", ">= 1"),
            (self.rl.kl_coef >= 0, "rl.kl_coef", ">= 0"),
            (self.rl.kl_kind in KL_KINDS, "rl.kl_kind", f"one of {KL_KINDS}"),
            (self.task.digits >= 1, "task.digits", ">= 1"),
            (self.task.kind in ("arithmetic", "jsonl"), "task.kind", "arithmetic or jsonl"),
            (self.task.kind != "jsonl" or bool(self.task.path), "task.path", "a JSONL file for task.kind=jsonl"),
            (not self.model.hf or Path(self.model.hf, "config.json").exists(), "model.hf",
             "an HF checkpoint directory with a config.json"),
            (not (self.model.hf and self.model.megatron), "model.hf / model.megatron", "set one at most"),
            (not self.model.megatron or Path(self.model.megatron, "trace_model.json").exists(), "model.megatron",
             "a Megatron checkpoint directory written by TRACE (with trace_model.json)"),
            (self.sft.steps >= 0 and self.rl.steps >= 0, "sft.steps / rl.steps", ">= 0"),
            (self.checkpoint.every >= 0 and self.checkpoint.sft_every >= 0, "checkpoint.every / sft_every", ">= 0"),
            (self.checkpoint.keep >= 1, "checkpoint.keep", ">= 1"),
            (self.dist.engine_ranks >= 0, "dist.engine_ranks", ">= 0"),
            (min(self.dist.tp, self.dist.ep, self.dist.pp, self.dist.etp) >= 1, "dist.tp / ep / pp / etp", ">= 1"),
            (self.dist.bridge in ("auto", "gloo", "nccl"), "dist.bridge", "auto, gloo or nccl"),
            (self.dist.recompute in ("none", "full", "selective"), "dist.recompute", "none, full or selective"),
            (self.dist.engine_tp >= 1, "dist.engine_tp", ">= 1"),
            (self.rl.max_tokens_per_microbatch >= 0, "rl.max_tokens_per_microbatch", ">= 0 (0: no limit)"),
            (self.rl.max_prompt_tokens >= 1 and self.rl.max_new_tokens >= 1, "rl.max_prompt_tokens / max_new_tokens",
             ">= 1"),
            (self.cluster.nodes >= 1 and self.cluster.gpus_per_node >= 1, "cluster.nodes / gpus_per_node", ">= 1"),
            (0 <= self.cluster.engine_nodes < self.cluster.nodes, "cluster.engine_nodes",
             "between 0 and cluster.nodes - 1 (trainer nodes are the rest)"),
            (self.cluster.gpu_memory_gib > 0 and self.cluster.host_memory_gib > 0, "cluster.gpu_memory_gib / "
             "host_memory_gib", "> 0"),
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
    if isinstance(current, bool) and isinstance(raw, str):
        if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"config: {dotted} must be true or false, got {raw!r}")
        raw = raw.lower() in ("true", "1", "yes")
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


def flat_config(cfg: TrainConfig) -> dict:
    """{"section.key": value} of every setting."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out |= {f"{f.name}.{k}": x for k, x in dataclasses.asdict(v).items()} if dataclasses.is_dataclass(v) \
            else {f.name: v}
    return out


# settings a resumed run may change: how long it runs and how it checkpoints
RESUMABLE = ("sft.steps", "rl.steps", "checkpoint.every", "checkpoint.sft_every", "checkpoint.keep",
             "checkpoint.resume", "output_dir")


class MetricsLog:
    """metrics.jsonl (one JSON object per RL step) and TensorBoard scalars under output_dir/tb."""

    def __init__(self, out_dir: Path, first_step: int):
        self.path = out_dir / "metrics.jsonl"
        rows = [line for line in self.path.read_text().splitlines() if line.strip()] if self.path.exists() else []
        # a resumed run recomputes the steps after its checkpoint; a new run starts empty
        kept = [r for r in rows if json.loads(r)["step"] < first_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(r + "\n" for r in kept))
        tmp.replace(self.path)
        self.history = [json.loads(r) for r in kept]
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=first_step)

    def write(self, m: dict) -> None:
        line = json.dumps(m)
        self.history.append(json.loads(line))  # as a resumed run reads it back (layer keys as strings)
        with self.path.open("a") as f:
            f.write(line + "\n")
        for k, v in m.items():
            if isinstance(v, (int, float)) and k != "step":
                self.tb.add_scalar(k, v, m["step"])
            elif isinstance(v, dict):  # per layer
                for layer, x in v.items():
                    self.tb.add_scalar(f"{k}/{layer}", x, m["step"])
        self.tb.flush()


def engine_settings(cfg: TrainConfig, guide: str | None = None) -> tuple[str, str, str]:
    """(precision, guidance policy, coding) of the rollout engine for the run's mode (`guide`
    overrides rl.guide, e.g. with what a budget resolved to). fp4-qat records dense guidance it
    does not apply, to measure flips (rl.measure_flips)."""
    trace, measure = cfg.rl.precision == "trace", cfg.rl.measure_flips and cfg.rl.precision == "fp4-qat"
    policy = guide or cfg.rl.guide
    return ("bf16" if cfg.rl.precision == "bf16" else "fp4", policy if trace else "all" if measure else "none",
            cfg.rl.coding if trace else "dense")


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The model's architecture: from model.hf's config.json, else the preset."""
    from ..model_config import PRESETS

    if cfg.model.hf:
        from ..checkpoint.hf import HFCheckpoint

        return HFCheckpoint(cfg.model.hf).cfg
    if cfg.model.megatron:
        from ..checkpoint.dist import read_config

        return read_config(cfg.model.megatron)
    if cfg.model.preset not in PRESETS:
        from .plan import PLAN_ONLY

        raise ValueError(f"model.preset {cfg.model.preset} is plan-only: {PLAN_ONLY[cfg.model.preset].implemented}")
    return PRESETS[cfg.model.preset]


def make_task(section: TaskSection, seed: int):
    """The task the section describes (see rl.tasks)."""
    from .rewards import load_reward
    from .tasks import ArithmeticTask, CharTokenizer, HFTokenizer, JsonlTask

    if section.kind == "arithmetic":
        return ArithmeticTask(section.digits, section.ops, seed=seed)
    tokenizer = CharTokenizer() if section.tokenizer == "char" else HFTokenizer(section.tokenizer)
    return JsonlTask(section.path, tokenizer, load_reward(section.reward), seed=seed)


def _resolve_budget(cfg: TrainConfig, trainer, make_engine, task, model_cfg: ModelConfig) -> str:
    """Measure flips and guidance cost per layer on one calibration rollout (prompts drawn without
    moving the task's draw state) and resolve rl.guide's budget to a layer list."""
    from .budget import resolve_budget

    snapshot = task.state_dict()
    prompts = [tuple(task.prompt_ids(p)) for p in task.problems(cfg.rl.prompts_per_step)]
    task.load_state_dict(snapshot)
    sampling = SamplingParams(temperature=cfg.rl.temperature, max_new_tokens=cfg.rl.max_new_tokens,
                              stop_token_ids=(task.tokenizer.eos_id,), seed=cfg.seed * 100_003 - 1)
    step_cfg = StepConfig(group_size=cfg.rl.group_size, max_tokens_per_microbatch=cfg.rl.max_tokens_per_microbatch)
    guide, flips, cost = resolve_budget(cfg.rl.guide, trainer, make_engine, prompts, step_cfg, cfg.rl.coding, sampling,
                                        model_cfg.num_layers)
    if _rank0():
        print(f"{cfg.rl.guide}: guiding {guide} (flip rate by layer {', '.join(f'{v:.2%}' for v in flips.values())}; "
              f"bytes per token {', '.join(f'{v:.0f}' for v in cost.values())})")
    return guide


def _rank0() -> bool:
    return not distributed_trainer() or torch.distributed.get_rank() == 0


def _optimizer(trainer, lr: float):
    """AdamW on FP32 masters; across trainer ranks its step first reduces the gradients."""
    opt = MasterAdamW(trainer.parameters(), lr=lr, weight_decay=0.0)
    if distributed_trainer():
        from .disaggregated import ReducingOptimizer

        return ReducingOptimizer(opt, trainer)
    return opt


def _reference(trainer, model_cfg: ModelConfig, path: Path, resumed: bool):
    """The frozen reference of the KL penalty: the model RL starts from, kept at `path` (a
    Megatron checkpoint) so that a resumed run penalises against the same one."""
    import shutil

    from ..checkpoint.dist import load_model, save_model
    from ..megatron.model import build_model

    reference = build_model(model_cfg, "bf16", grouped_gemm=True)
    if resumed and path.exists():
        load_model(reference, path)
    else:
        if _rank0():
            shutil.rmtree(path, ignore_errors=True)  # of an earlier run in this output_dir
        reference.load_state_dict(trainer.state_dict())  # the same layout: the same local names
        save_model(reference, model_cfg, path)  # collective: its first step orders the removal above
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def train(cfg: TrainConfig, make_engine, model_cfg: ModelConfig, progress: bool = True) -> list[dict]:
    """Warm-up, then RL; every RL step's metrics go to output_dir/metrics.jsonl and TensorBoard.
    Checkpoints as `checkpoint` says; with checkpoint.resume a killed run continues from the
    latest one as it would have. Returns the metrics of every RL step of the run."""
    from tqdm import tqdm

    from ..megatron.model import build_model
    from .checkpoint import (
        RunState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from .sft import sft_step

    torch.manual_seed(cfg.seed)
    progress = progress and _rank0()
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(cfg.task, cfg.seed)
    if task.tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the task's tokenizer needs {task.tokenizer.vocab_size} ids, the model has {model_cfg.vocab_size}")
    if cfg.dist.engine_tp != 1:
        raise ValueError("dist.engine_tp: the built-in engine runs on one GPU; engine tensor parallelism is for "
                         "`trace-rl plan` until the SGLang backend lands")
    trainer = build_model(model_cfg, "bf16", grouped_gemm=True,  # BF16 compute, as the engine
                          recompute=None if cfg.dist.recompute == "none" else cfg.dist.recompute)
    if cfg.model.hf:
        from ..checkpoint.hf import HFCheckpoint
        from ..megatron.weights import load_full_state_dict

        load_full_state_dict(trainer, HFCheckpoint(cfg.model.hf))
    elif cfg.model.megatron:
        from ..checkpoint.dist import load_model

        load_model(trainer, cfg.model.megatron)
    run_config, state, saved = flat_config(cfg), RunState(), None
    ckpt = latest_checkpoint(out_dir) if cfg.checkpoint.resume else None
    if ckpt is not None:
        saved = load_checkpoint(ckpt, trainer, run_config, RESUMABLE)
        state = RunState(**saved["state"])
        task.load_state_dict(saved["task"])
        torch.set_rng_state(saved["torch_rng"])
        if _rank0():
            print(f"resuming from {ckpt} ({state.phase} step {state.step})")

    def checkpoint(opt, phase, step, version):
        save_checkpoint(out_dir, trainer, model_cfg, opt, task.state_dict(), RunState(phase, step, version, state.guide),
                        run_config, cfg.checkpoint.keep)

    if state.phase == "sft" and state.step < cfg.sft.steps:
        opt = _optimizer(trainer, cfg.sft.lr)
        if saved is not None:
            opt.load_state_dict(saved["optimizer"])
        bar = tqdm(range(state.step, cfg.sft.steps), desc="sft", disable=not progress, initial=state.step,
                   total=cfg.sft.steps)
        for i in bar:
            loss = sft_step(trainer, opt, [task.sft_example(p) for p in task.problems(cfg.sft.batch)])
            bar.set_postfix(loss=f"{loss:.3f}")
            if cfg.checkpoint.sft_every and (i + 1) % cfg.checkpoint.sft_every == 0 and i + 1 < cfg.sft.steps:
                checkpoint(opt, "sft", i + 1, 0)
        del opt  # before the RL optimizer's masters exist
    if state.phase == "sft":
        state, saved = RunState("rl", 0, 0), None
    opt = _optimizer(trainer, cfg.rl.lr)
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
    elif cfg.sft.steps:
        checkpoint(opt, "rl", 0, 0)  # the warmed-up model: RL restarts never redo the warm-up
    if state.step >= cfg.rl.steps:  # nothing left to do (e.g. `trace-rl sft`)
        return []
    if cfg.rl.precision == "trace" and cfg.rl.guide.startswith("budget:") and not state.guide:
        state.guide = _resolve_budget(cfg, trainer, make_engine, task, model_cfg)
    engine = make_engine(*engine_settings(cfg, state.guide))
    sync_weights(trainer, engine, state.weight_version)
    step_cfg = StepConfig(cfg.rl.precision, cfg.rl.group_size, cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.correction,
                          dynamic_sampling=cfg.rl.dynamic_sampling, max_rounds=cfg.rl.max_rounds,
                          kl_coef=cfg.rl.kl_coef, kl_kind=cfg.rl.kl_kind,
                          max_tokens_per_microbatch=cfg.rl.max_tokens_per_microbatch)
    reference = _reference(trainer, model_cfg, out_dir / "checkpoints" / "reference", resumed=saved is not None) \
        if cfg.rl.kl_coef else None
    log = MetricsLog(out_dir, state.step) if _rank0() else None
    run_history = []
    bar = tqdm(range(state.step, cfg.rl.steps), desc=f"rl ({cfg.rl.precision})", disable=not progress,
               initial=state.step, total=cfg.rl.steps)
    by_prompt = {}  # prompt ids -> problem, for the reward

    def draw(n):
        problems = task.problems(n)
        prompts = [tuple(task.prompt_ids(p)) for p in problems]
        longest = max(map(len, prompts), default=0)
        if longest > cfg.rl.max_prompt_tokens:
            raise ValueError(f"a prompt of {longest} tokens exceeds rl.max_prompt_tokens={cfg.rl.max_prompt_tokens}")
        by_prompt.update(zip(prompts, problems))
        return prompts

    def reward(prompt, resp):
        return task.reward(by_prompt[tuple(prompt)], resp)

    for step in bar:
        by_prompt.clear()
        t0 = time.perf_counter()
        m = rl_step(trainer, opt, engine, draw(cfg.rl.prompts_per_step), reward, step_cfg,
                    SamplingParams(temperature=cfg.rl.temperature, max_new_tokens=cfg.rl.max_new_tokens,
                                   stop_token_ids=(task.tokenizer.eos_id,), seed=cfg.seed * 100_003 + step), step,
                    more_prompts=draw, reference=reference)
        m["step_s"] = time.perf_counter() - t0
        if distributed_trainer():
            from .disaggregated import average_metrics

            m = average_metrics(m)
        if log is not None:
            log.write(m)
        run_history.append(m)
        bar.set_postfix(reward=f"{m['reward']:.2f}", k3=f"{m.get('k3_kl', float('nan')):.1e}")
        if (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or step + 1 == cfg.rl.steps:
            checkpoint(opt, "rl", step + 1, engine.weight_version)
    if log is None:  # not trainer rank 0: it reports
        return []
    log.tb.close()
    if log.history:
        plot_report(log.history, out_dir / "report.png", f"{cfg.model.preset}, {cfg.rl.precision} mode")
    return run_history
