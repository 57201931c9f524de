"""The one configuration schema of a TRACE run: `trace-rl train`, `sft`, `plan` and `slurm` read it.

Sections are frozen, keyword-only dataclasses; each field carries its type (`Literal[...]` or an
enum for choices) and a docstring, and each section checks its own fields beside them
(`check`). A configuration is built from the defaults, then a YAML file `{section: {key:
value}}`, then `section.key=value` overrides (`load_config`); an unknown key, a value of the
wrong type or out of range is a ValueError that names the key. `reference_markdown()` renders
the schema as docs/configuration.md (`trace-rl config --reference`).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import ClassVar, Literal

from .guidance import Coding, LayerPolicy
from .model_config import PRESETS
from .modes import RunMode
from .rl.losses import Correction, KLKind

# keys that were renamed: an old config file gets an error that names the new key
RENAMED_KEYS = {"rl.precision": "rl.mode", "engine": "rollout.backend"}


def require(ok: bool, key: str, want: str) -> None:
    """Raise ValueError("config: <key> must be <want>") unless `ok`."""
    if not ok:
        raise ValueError(f"config: {key} must be {want}")


class Section:
    """Base of the sections: coerces each field to its annotated type, then runs `check`."""

    NAME: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(getattr(self, f.name), hints[f.name], f"{self.NAME}.{f.name}")
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """The section's own checks (ranges, combinations): ValueError naming the key."""


@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """The model: a preset with random initialisation, an HF checkpoint, or a TRACE Megatron
    checkpoint (set one of `hf` / `megatron` at most; either replaces the preset)."""

    NAME: ClassVar[str] = "model"

    preset: str = "demo"
    """A key of `model_config.PRESETS` (random initialisation, then SFT); one whose architecture
    some part of TRACE does not build yet (`deepseek-v3`: `ModelConfig.unbuilt`) is for `trace-rl
    plan` alone."""
    hf: str = ""
    """An HF checkpoint directory (Qwen3-MoE; DeepSeek-V3 or GLM-4.5 with the Megatron trainer and
    the built-in engine; DeepSeek-V3 with SGLang too): its config.json and safetensors weights."""
    megatron: str = ""
    """A Megatron checkpoint directory written by TRACE (e.g. a run's `checkpoints/rl-000040/model`)."""

    def check(self) -> None:
        require(self.preset in PRESETS, "model.preset", f"one of {sorted(PRESETS)}")
        require(not (self.hf and self.megatron), "model.hf / model.megatron", "set one at most")
        require(not self.hf or Path(self.hf, "config.json").exists(), "model.hf",
                "an HF checkpoint directory with a config.json")
        require(not self.megatron or Path(self.megatron, "trace_model.json").exists(), "model.megatron",
                "a Megatron checkpoint directory written by TRACE (with trace_model.json)")


@dataclass(frozen=True, kw_only=True)
class TaskSection(Section):
    """The task: prompts, their answers and the reward (see `rl.tasks`, `rl.rewards`)."""

    NAME: ClassVar[str] = "task"

    kind: Literal["arithmetic", "chain", "jsonl"] = "arithmetic"
    """`arithmetic` (built in: sums, differences or products of two random numbers), `chain` (built
    in: `terms` operands, answered with worked steps, rewarded on the final answer; a held-out
    split for evaluation) or `jsonl` (a file of {"prompt", "answer"})."""
    digits: int = 2
    """arithmetic: digits per operand (at most); chain: digits per operand (exactly)."""
    ops: str = "+"
    """arithmetic, chain: the operators to draw from (of `+-*`)."""
    terms: int = 4
    """chain: operands per problem (>= 2)."""
    path: str = ""
    """jsonl: the file of {"prompt": ..., "answer": ...} lines."""
    reward: str = "math"
    """jsonl: `exact`, `math` (final boxed / #### / last number) or
    `package.module:function(prompt, response, answer)`."""
    tokenizer: str = "char"
    """jsonl: `char` (the built-in alphabet) or an HF tokenizer directory."""

    def check(self) -> None:
        require(self.digits >= 1, "task.digits", ">= 1")
        require(self.terms >= 2, "task.terms", ">= 2")
        require(self.kind != "jsonl" or bool(self.path), "task.path", "a JSONL file for task.kind=jsonl")


@dataclass(frozen=True, kw_only=True)
class SFTSection(Section):
    """The supervised warm-up before RL (skipped with steps=0)."""

    NAME: ClassVar[str] = "sft"

    steps: int = 800
    """Optimizer steps of the warm-up."""
    batch: int = 64
    """Examples per step."""
    lr: float = 3e-3
    """AdamW learning rate."""
    label_noise: float = 0.0
    """Share of demonstrations whose (integer) answer is a near miss (+-1 or +-10), as imperfect
    data has: the warm-up then teaches wrong answers too, which RL on the exact reward unlearns."""

    def check(self) -> None:
        require(self.steps >= 0, "sft.steps", ">= 0")
        require(0 <= self.label_noise < 1, "sft.label_noise", "in [0, 1)")
        require(self.batch >= 1, "sft.batch", ">= 1")
        require(self.lr > 0, "sft.lr", "> 0")


@dataclass(frozen=True, kw_only=True)
class RLSection(Section):
    """GRPO on the engine's rollouts: what one RL step does (`rl.step` reads this section)."""

    NAME: ClassVar[str] = "rl"

    steps: int = 60
    """RL steps (each: rollout, `mini_batches` x `epochs` optimizer steps, weight sync)."""
    prompts_per_step: int = 16
    """Prompts drawn per step (GRPO groups)."""
    prompt_set: int = 32
    """RL prompts from a fixed set of this many of the task's problems (an RL dataset), gone
    through in epochs, reshuffled each; 0: fresh problems every step."""
    group_size: int = 8
    """Samples per prompt; advantages are normalised within a group."""
    max_new_tokens: int = 5
    """Response length limit."""
    max_prompt_tokens: int = 16
    """Longest prompt; a longer one is an error (the plan sizes KV cache and activations with it)."""
    mini_batches: int = 2
    """Optimizer steps per pass over a rollout: its groups split into this many mini-batches (verl's
    ppo_mini_batch_size = prompts_per_step / mini_batches; slime's num_steps_per_rollout =
    mini_batches x epochs); fewer when a rank has fewer groups."""
    epochs: int = 1
    """Passes over each rollout (verl's ppo_epochs). With more than one update per rollout the PPO
    old log-probs are the trainer's before the first update, from one extra forward."""
    max_tokens_per_microbatch: int = 0
    """Trainer micro-batches of at most this many tokens (gradients accumulate); 0: all of a rank's samples at once."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    lr: float = 4e-4
    """AdamW learning rate."""
    mode: RunMode = RunMode.TRACE
    """Engine and trainer precision (`modes.RunMode`): `bf16`, `fp4-rollout` (FP4 engine, BF16
    trainer), `fp4-qat` (FP4 QAT, round to nearest), `trace` (FP4 QAT following the engine's guidance)."""
    guide: str = "all"
    """trace: the layers whose rounding is guided: `all`, `deep:K`, `layers:i,j`, `budget:<bytes per token>`
    or `none`."""
    coding: Coding = Coding.DENSE
    """trace: guidance coding, `dense` (every element's mantissa bit) or `sparse` (only elements near a
    rounding boundary)."""
    correction: Correction = "none"
    """Rollout correction, verl's meanings: `none`, `tis` (token truncated IS) or `mis` (sequence masked IS)."""
    correction_threshold: float = 2.0
    """tis: the weight's upper bound; mis: sequences whose ratio lies outside [1/t, t] are rejected."""
    clip_low: float = 0.2
    """PPO clip range below 1."""
    clip_high: float = 0.28
    """PPO clip range above 1 (above clip_low: DAPO's clip-higher)."""
    clip_ratio_c: float = 3.0
    """verl's dual-clip: the loss of a negative-advantage token is capped at -A * clip_ratio_c
    (ratios far above 1 stop pushing); 0: off."""
    dynamic_sampling: bool = False
    """DAPO: train only on groups whose rewards differ, sampling more prompts to refill."""
    max_rounds: int = 3
    """Dynamic sampling: rollout rounds per step at most."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (the model RL starts from); 0: none."""
    kl_kind: KLKind = "k3"
    """KL estimator: `k1`, `k2` or `k3` (verl's low_var_kl)."""
    measure_flips: bool = True
    """fp4-qat: the engine also records dense guidance (not applied) so that flip rates can be measured."""

    def check(self) -> None:
        for key in ("steps", "max_tokens_per_microbatch", "prompt_set"):
            require(getattr(self, key) >= 0, f"rl.{key}", ">= 0")
        for key in ("prompts_per_step", "max_new_tokens", "max_prompt_tokens", "max_rounds", "mini_batches",
                    "epochs"):
            require(getattr(self, key) >= 1, f"rl.{key}", ">= 1")
        require(self.group_size >= 2, "rl.group_size", ">= 2 (GRPO normalises within groups)")
        require(self.temperature >= 0, "rl.temperature", ">= 0")
        require(self.lr > 0, "rl.lr", "> 0")
        require(self.correction_threshold > 1, "rl.correction_threshold", "> 1")
        require(0 <= self.clip_low < 1 and self.clip_high >= 0, "rl.clip_low / clip_high", "in [0, 1) and >= 0")
        require(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "rl.clip_ratio_c", "0 (off) or > 1 (verl's dual-clip)")
        require(self.mini_batches <= self.prompts_per_step, "rl.mini_batches",
                f"at most rl.prompts_per_step ({self.prompts_per_step}): a mini-batch holds whole groups")
        require(self.kl_coef >= 0, "rl.kl_coef", ">= 0")
        try:
            LayerPolicy.parse(self.guide)
        except ValueError as e:
            raise ValueError(f"config: rl.guide: {e}") from None


@dataclass(frozen=True, kw_only=True)
class TrainerSection(Section):
    """The trainer: Megatron-core (any TP / EP / PP / DP layout, its DDP and distributed optimizer;
    the default) or DeepSpeed over transformers' Qwen3-MoE (ZeRO-1/2/3 data parallelism on the HF
    checkpoint `model.hf`, no conversion; docs/deepspeed.md). Both run the same FP4 QAT, guidance,
    routing replay and RL loop."""

    NAME: ClassVar[str] = "trainer"

    backend: Literal["megatron", "deepspeed"] = "megatron"
    """`megatron` or `deepspeed` (needs model.hf; dist.tp / ep / pp / etp stay 1)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Megatron's layer implementation (its own setting of that name): `local` (TRACE's FP4 linears
    on Megatron's local backend; no TE needed) or `transformer_engine` (TE's linears and grouped
    experts under TRACE's TE recipe, docs/notes/te-fp4-recipe.md; a GPU with TE >= 2.19; GQA models,
    not MLA)."""
    megatron: dict = field(default_factory=dict)
    """Megatron-core's own TransformerConfig settings, passed through (e.g. its fused loss
    `{cross_entropy_loss_fusion: true, cross_entropy_fusion_impl: native}` on a GPU); the fields
    TRACE sets from the model and dist sections are refused, naming the section that owns them.
    Checked against TransformerConfig's fields at start."""
    deepspeed: dict = field(default_factory=dict)
    """DeepSpeed's own config, passed through as its JSON (e.g. `{zero_optimization: {stage: 3},
    bf16: {enabled: true}}`); TRACE adds the batch keys it owns and, unless the config has its own
    `optimizer`, torch's AdamW with optim's settings. Checked by DeepSpeed at start."""

    def check(self) -> None:
        require(all(isinstance(k, str) for k in self.deepspeed), "trainer.deepspeed", "a mapping with string keys")
        require(not self.deepspeed or self.backend == "deepspeed", "trainer.deepspeed",
                f"empty unless trainer.backend is deepspeed (it is {self.backend!r}: the options would be ignored)")
        require(all(isinstance(k, str) for k in self.megatron), "trainer.megatron", "a mapping with string keys")
        require(not self.megatron or self.backend == "megatron", "trainer.megatron",
                f"empty unless trainer.backend is megatron (it is {self.backend!r}: the options would be ignored)")
        if self.megatron:
            from .megatron.options import check_megatron_options

            check_megatron_options(self.megatron, "trainer.megatron")
        require(self.transformer_impl == "local" or self.backend == "megatron", "trainer.transformer_impl",
                f"local with trainer.backend={self.backend} (Megatron's setting; DeepSpeed runs transformers' model)")


@dataclass(frozen=True, kw_only=True)
class OptimSection(Section):
    """The trainer's optimizer: Megatron-core's DistributedDataParallel and `get_megatron_optimizer`
    (AdamW on FP32 main parameters of the BF16 model); under trainer.backend=deepspeed, AdamW inside
    DeepSpeed's engine (clip_grad, weight_decay and lr_warmup_steps apply; the Megatron fields do
    not). The learning rates are sft.lr and rl.lr."""

    NAME: ClassVar[str] = "optim"

    clip_grad: float = 1.0
    """Gradient clipping to this global L2 norm (Megatron's clip_grad); 0: no clipping."""
    distributed: bool = True
    """Megatron's distributed optimizer: FP32 main parameters and AdamW moments sharded over the
    data-parallel ranks (expert parameters over the expert-data-parallel ranks)."""
    cpu_offload: bool = False
    """Megatron's optimizer_cpu_offload, all of it, precision-aware (HybridDeviceOptimizer: FP32
    masters, a gradient copy and AdamW moments of this rank's shard on the host, the step on the
    CPU; the GPU keeps no optimizer state). Needs optim.distributed."""
    overlap_grad_reduce: bool = True
    """Reduce gradients bucket by bucket while backward runs (with data parallelism)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_warmup_steps: int = 10
    """Optimizer steps of linear learning-rate warm-up from 0 at the start of each phase (SFT, RL;
    Megatron's OptimizerParamScheduler), constant after; 0: none."""
    megatron: dict = field(default_factory=dict)
    """Further fields of megatron.core's OptimizerConfig or DistributedDataParallelConfig, passed
    through as given (e.g. `{adam_beta2: 0.95, bucket_size: 40000000}`); checked against them at start."""

    def check(self) -> None:
        require(self.clip_grad >= 0, "optim.clip_grad", ">= 0")
        require(self.weight_decay >= 0, "optim.weight_decay", ">= 0")
        require(self.lr_warmup_steps >= 0, "optim.lr_warmup_steps", ">= 0")
        require(self.distributed or not self.cpu_offload, "optim.cpu_offload", "false without optim.distributed")
        require(all(isinstance(k, str) for k in self.megatron), "optim.megatron", "a mapping with string keys")


@dataclass(frozen=True, kw_only=True)
class RolloutSection(Section):
    """The rollout engine: TRACE's built-in engine or SGLang (the same FP4 policy, guidance and
    routed experts; sglang_rollout/sglang/README.md), colocated or on `dist.engine_ranks`."""

    NAME: ClassVar[str] = "rollout"

    backend: str = "builtin"
    """`builtin` (one GPU per engine), `sglang` (SGLang's Engine with TRACE's plugin; `dist.engine_tp`
    GPUs per engine), or a backend class by dotted path `module:Class` (its module exports its EngineConfig)."""
    sglang: dict = field(default_factory=dict)
    """SGLang's own ServerArgs, passed through to every SGLang engine (e.g. `{mem_fraction_static: 0.6,
    ep_size: 2}`); they win over what TRACE derives. Checked against SGLang's ServerArgs at start."""

    def check(self) -> None:
        from .backend import BACKENDS

        require(self.backend in BACKENDS or ":" in self.backend, "rollout.backend",
                f"one of {', '.join(BACKENDS)} or a dotted path module:Class, not {self.backend!r}")
        require(all(isinstance(k, str) for k in self.sglang), "rollout.sglang", "a mapping with string keys")
        require(not self.sglang or self.backend == "sglang", "rollout.sglang",
                f"empty unless rollout.backend is sglang (it is {self.backend!r}: the options would be ignored)")


@dataclass(frozen=True, kw_only=True)
class CheckpointSection(Section):
    """When the run checkpoints, and whether it resumes (`rl.run_checkpoint`)."""

    NAME: ClassVar[str] = "checkpoint"

    every: int = 10
    """RL steps between checkpoints (and one at the end of each phase); 0: only at the ends."""
    sft_every: int = 250
    """SFT steps between checkpoints; 0: none during the warm-up."""
    keep: int = 2
    """Newest checkpoints kept."""
    resume: bool = True
    """Continue from output_dir's latest checkpoint when there is one."""

    def check(self) -> None:
        require(self.every >= 0 and self.sft_every >= 0, "checkpoint.every / sft_every", ">= 0")
        require(self.keep >= 1, "checkpoint.keep", ">= 1")


@dataclass(frozen=True, kw_only=True)
class DistSection(Section):
    """Processes: colocated in one, or a torchrun / SLURM job of trainer and engine ranks."""

    NAME: ClassVar[str] = "dist"

    engine_ranks: int = 0
    """0: trainer and engine in one process; > 0: ranks of a torchrun job that serve rollouts (launch/local.sh),
    each running one engine of `dist.engine_tp` GPUs: on a node the trainer ranks take the first GPUs, one each,
    and the engine ranks the next ones. With cluster.engine_nodes: engine_nodes x gpus_per_node / engine_tp."""
    tp: int = 1
    """Trainer tensor parallelism (sequence parallel with it); data parallelism fills the rest."""
    ep: int = 1
    """Trainer expert parallelism."""
    pp: int = 1
    """Trainer pipeline parallelism (1F1B schedule)."""
    etp: int = 1
    """Trainer expert tensor parallelism."""
    bridge: Literal["auto", "gloo", "nccl"] = "auto"
    """Trainer <-> engine transport: `auto` (NCCL when every rank has its own GPU), `gloo` or `nccl`."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Trainer activation recompute: `none`, `full` (every layer) or `selective` (the MoE layers)."""
    engine_tp: int = 1
    """GPUs per engine (per engine rank): SGLang's tp_size with rollout.backend=sglang (its expert parallelism
    `rollout.sglang={ep_size: N}`, N dividing it); the built-in engine runs on one."""
    sync_bucket_mb: float = 256.0
    """Weight sync: the largest packed bucket a trainer rank holds and sends at a time (MiB)."""

    def check(self) -> None:
        require(self.engine_ranks >= 0, "dist.engine_ranks", ">= 0")
        require(min(self.tp, self.ep, self.pp, self.etp) >= 1, "dist.tp / ep / pp / etp", ">= 1")
        require(self.engine_tp >= 1, "dist.engine_tp", ">= 1")
        require(self.sync_bucket_mb > 0, "dist.sync_bucket_mb", "> 0")


@dataclass(frozen=True, kw_only=True)
class ClusterSection(Section):
    """The machines: read by `trace-rl plan` and the SLURM launcher, never by training itself,
    so that one config file describes the run on any launcher."""

    NAME: ClassVar[str] = "cluster"

    nodes: int = 1
    """SLURM nodes in all."""
    engine_nodes: int = 0
    """Of which rollout-engine nodes (disaggregated, the last ones); each runs gpus_per_node / dist.engine_tp
    engine ranks (dist.engine_ranks in all)."""
    gpus_per_node: int = 8
    """GPUs per node."""
    gpu_memory_gib: float = 141.0
    """Memory per GPU (H200: 141)."""
    host_memory_gib: float = 2000.0
    """Memory per node (guidance waits there; `optim.cpu_offload` puts the optimizer state there)."""
    network_gbps: float = 400.0
    """Network between nodes per GPU, Gb/s each way (H100/H200 nodes: 8 x 400 Gb/s InfiniBand NDR,
    a NIC per GPU); `trace-rl plan` turns the traffic between nodes into time with it."""
    nvlink_gbs: float = 450.0
    """NVLink per GPU inside a node, GB/s each way (H100/H200: 450; NVIDIA's 900 GB/s counts both
    directions); `trace-rl plan` turns the traffic inside a node into time with it."""
    partition: str = ""
    """SLURM partition (empty: the cluster's default)."""
    account: str = ""
    """SLURM account (empty: none)."""
    time: str = "24:00:00"
    """SLURM time limit (quote it in YAML: an unquoted 24:00:00 is a number there)."""
    setup: str = ""
    """Shell run on every node before the job: module load, source .venv/bin/activate, ..."""
    container: str = ""
    """Container image for srun --container-image (pyxis); empty: none."""
    nccl_ifname: str = ""
    """NCCL_SOCKET_IFNAME (e.g. ib0); empty: NCCL's choice."""
    gloo_ifname: str = ""
    """GLOO_SOCKET_IFNAME; empty: gloo's choice."""
    log_dir: str = "logs"
    """Per-node log files of the SLURM job."""

    def check(self) -> None:
        require(self.nodes >= 1 and self.gpus_per_node >= 1, "cluster.nodes / gpus_per_node", ">= 1")
        require(0 <= self.engine_nodes < self.nodes, "cluster.engine_nodes",
                "between 0 and cluster.nodes - 1 (trainer nodes are the rest)")
        require(self.gpu_memory_gib > 0 and self.host_memory_gib > 0, "cluster.gpu_memory_gib / host_memory_gib",
                "> 0")
        require(self.network_gbps > 0 and self.nvlink_gbs > 0, "cluster.network_gbps / nvlink_gbs", "> 0")


SECTIONS: dict[str, type[Section]] = {cls.NAME: cls for cls in (
    ModelSection, TaskSection, SFTSection, RLSection, TrainerSection, OptimSection, RolloutSection, CheckpointSection,
    DistSection, ClusterSection)}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole run: its sections and two top-level settings."""

    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    optim: OptimSection = field(default_factory=OptimSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    dist: DistSection = field(default_factory=DistSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    output_dir: str = "runs/default"
    """Where metrics, TensorBoard logs, the report plot and checkpoints go."""
    seed: int = 0
    """Seeds the initial weights, the task's draws and the sampling."""

    def __post_init__(self) -> None:
        hints = _hints(TrainConfig)
        for key in TOP_LEVEL:
            object.__setattr__(self, key, _coerce(getattr(self, key), hints[key], key))
        if self.trainer.backend == "deepspeed":
            self._check_deepspeed()

    def _check_deepspeed(self) -> None:
        """What trainer.backend=deepspeed needs of the other sections (ValueError naming the key)."""
        d, o = self.dist, self.optim
        require(bool(self.model.hf), "model.hf", "an HF checkpoint directory with trainer.backend=deepspeed (it "
                "trains the HF model as it is)")
        require(d.tp == d.ep == d.pp == d.etp == 1, "dist.tp / ep / pp / etp",
                "1 with trainer.backend=deepspeed (ZeRO data parallelism over the trainer ranks)")
        require(d.recompute == "none", "dist.recompute", "none with trainer.backend=deepspeed (DeepSpeed's own "
                "activation checkpointing goes in trainer.deepspeed)")
        require(not o.megatron, "optim.megatron", "empty with trainer.backend=deepspeed (it is Megatron's)")
        require(not o.cpu_offload, "optim.cpu_offload", "false with trainer.backend=deepspeed (ZeRO's "
                "offload_optimizer goes in trainer.deepspeed)")


TOP_LEVEL = ("output_dir", "seed")

# settings a resumed run may change: how long it runs, how it checkpoints, and the trainer's
# parallel layout (model and optimizer state are Megatron distributed checkpoints)
RESUMABLE = ("sft.steps", "rl.steps", "checkpoint.every", "checkpoint.sft_every", "checkpoint.keep",
             "checkpoint.resume", "output_dir", "dist.tp", "dist.pp", "dist.ep", "dist.etp", "dist.engine_ranks",
             "dist.bridge", "dist.recompute", "dist.sync_bucket_mb", "optim.overlap_grad_reduce")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then a YAML file ({section: {key: value}}), then "section.key=value" overrides,
    checked: ValueError naming the first unknown key or bad value."""
    values: dict[str, dict | object] = {}
    if path:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config: {path} must hold a mapping {{section: {{key: value}}}}")
        for name, body in data.items():
            if isinstance(body, dict):
                for key, value in body.items():
                    _put(values, f"{name}.{key}", value)
            else:
                _put(values, str(name), body)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config override {item!r} must be section.key=value")
        _put(values, key.strip(), value.strip())
    sections = {name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()}
    return TrainConfig(**sections, **{k: values[k] for k in TOP_LEVEL if k in values})


def _put(values: dict, dotted: str, value) -> None:
    if dotted in RENAMED_KEYS:
        raise ValueError(f"config: {dotted} was renamed {RENAMED_KEYS[dotted]}")
    section, _, key = dotted.partition(".")
    if not key:
        if section in SECTIONS:
            raise ValueError(f"config: {section} is a section: give it {{key: value}} or {section}.key=value")
        if section not in TOP_LEVEL:
            raise ValueError(f"config: unknown key {dotted!r}")
        values[section] = value
        return
    if section not in SECTIONS:
        raise ValueError(f"config: unknown section {section!r} in {dotted!r}")
    if key not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
        raise ValueError(f"config: unknown key {dotted!r}")
    values.setdefault(section, {})[key] = value


def as_dict(cfg: TrainConfig) -> dict:
    """{section: {key: value}, top-level key: value}, plain Python values (YAML-ready)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = {k: _plain(x) for k, x in dataclasses.asdict(v).items()} if dataclasses.is_dataclass(v) \
            else _plain(v)
    return out


def flat_config(cfg: TrainConfig) -> dict:
    """{"section.key": value} of every setting (plain values: what checkpoints store)."""
    out = {}
    for name, v in as_dict(cfg).items():
        out |= {f"{name}.{k}": x for k, x in v.items()} if isinstance(v, dict) else {name: v}
    return out


def upgrade_flat_config(saved: dict) -> dict:
    """A checkpoint's flat config in today's vocabulary: renamed keys (and the run mode once
    called "fp4") under their new names, and keys added since filled with their defaults (the
    value the older code used)."""
    out = {RENAMED_KEYS.get(k, k): v for k, v in saved.items()}
    if out.get("rl.mode") == "fp4":
        out["rl.mode"] = RunMode.FP4_ROLLOUT.value
    for key, default in flat_config(TrainConfig()).items():
        out.setdefault(key, default)
    return out


def _plain(v):
    return v.value if isinstance(v, enum.Enum) else v


# -- types ---------------------------------------------------------------------------------
@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _coerce(value, tp, key: str):
    """`value` (from YAML, a `--set` string or Python) as type `tp`, or ValueError naming `key`."""
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        require(value in choices, key, f"one of {list(choices)}, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError as e:
            raise ValueError(f"config: {key}: {e}") from None
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        require(isinstance(value, bool), key, f"true or false, got {value!r}")
        return value
    if tp in (int, float):
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
        ok = isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool)
        require(ok, key, f"{'an int' if tp is int else 'a number'}, got {value!r}")
        return tp(value)
    if tp is dict:
        if isinstance(value, str):  # from --set: a YAML mapping
            import yaml

            value = yaml.safe_load(value) or {}
        require(isinstance(value, dict), key, f"a mapping {{key: value}}, got {value!r}")
        return dict(value)
    if tp is str:
        require(isinstance(value, str), key, f"a string, got {type(value).__name__} {value!r} (quote it in YAML)")
        return value
    raise TypeError(f"config: {key} has a type the loader does not know: {tp}")


# -- the reference (docs/configuration.md) --------------------------------------------------
@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: its docstring} of a dataclass whose fields carry attribute docstrings."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in tp)
    return tp.__name__


def reference_markdown() -> str:
    """The schema as Markdown: a table per section (key, type or choices, default, meaning)."""
    lines = ["# Configuration reference", "",
             "Generated from `megatron_trace/config.py` by `trace-rl config --reference`; a test keeps the two equal.",
             "A run reads the defaults, then `--config FILE.yaml` (`{section: {key: value}}`), then",
             "`--set section.key=value` overrides; `trace-rl config` prints the result.", ""]

    def table(cls, names, prefix):
        hints, docs = _hints(cls), field_docs(cls)
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name in names:
                default = _plain(f.default_factory() if f.default is dataclasses.MISSING else f.default)
                rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | `{default!r}` | {docs[f.name]} |")
        return rows

    for name, cls in SECTIONS.items():
        lines += [f"## `{name}`", "", " ".join(inspect.getdoc(cls).split()), ""]
        lines += table(cls, {f.name for f in dataclasses.fields(cls)}, f"{name}.") + [""]
    lines += ["## top level", ""] + table(TrainConfig, set(TOP_LEVEL), "") + [""]
    return "\n".join(lines)
