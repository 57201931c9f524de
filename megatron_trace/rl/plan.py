"""`trace-rl plan`: per-GPU memory and per-step traffic of a run, before it runs.

From the run's own config (model, `dist` layout, `rl` batch shape, `optim`, `cluster` machines
and network) it counts what each rank holds, as the trainer holds it on Megatron-core's
DistributedDataParallel and `get_megatron_optimizer` (`megatron/optimizer.py`):

- trainer GPU (the pipeline stage holding the most): BF16 parameters (norms FP32); DDP's
  contiguous FP32 gradient buffer (`grad_reduce_in_fp32`; full on every rank, reduce-scattered
  under the distributed optimizer); the optimizer's FP32 main parameters (4 B per BF16
  parameter; an FP32 one is its own) and AdamW moments (8 B per parameter), with
  `optim.distributed` a 1/DP shard of the dense parameters' and a 1/expert-DP shard of the
  experts', with `optim.cpu_offload` none of it (FP32 masters, a gradient copy, moments and
  the step on the host); QAT's dequantized weight copies and STE masks kept for backward; the KL reference's
  weights; activations of the rank's largest micro-batch (all its samples packed, sequence-
  parallel under TP; with recompute only layer inputs plus one layer); the logits; the decoded
  guidance of the micro-batches in flight; and, while the weights sync, one packed bucket;
- engine GPU: FP4 weights (codes + E4M3 block scales) or BF16, the FP4 KV cache of a step's
  in-flight samples (prompts stored once per group) and one received sync bucket; an SGLang
  engine GPU (`rollout.backend=sglang`) as SGLang fills it: its shard under engine TP / EP, the
  KV pool SGLang sizes from mem_fraction_static, a workspace (`plan_sglang`);
- host memory per node: one sync bucket per trainer rank (each rank quantizes and sends its own
  shards in buckets of `dist.sync_bucket_mb` to the engines: no rank holds the whole model),
  the offloaded optimizer state, and the guidance waiting for the trainers / recorded by the
  engines, in its wire form;
- per step, in bytes and in seconds on the cluster's network (`cluster.network_gbps` per GPU
  between nodes, `cluster.nvlink_gbs` inside one): the weight sync (every engine receives the
  packed model), the guidance in the configured coding (sparse: its measured size, see
  `SPARSE_KEPT`), the routed expert ids (uint8 up to 256 experts, else int16) and each GPU's
  gradient reduction (an all-reduce, or under the distributed optimizer a reduce-scatter of the
  gradients and an all-gather of the updated parameters).

Activation counts are estimates (what autograd saves per token in our layer, in BF16); the
memory is otherwise exact up to Megatron's buffer padding (64 elements per parameter). Seconds
are at the link rate, spread evenly over the GPUs that send and receive: lower bounds (NCCL
reaches ~80-90 % of it; overlap hides part of the gradient reduction). A layout that does not
fit is refused with the shortfall. `choose_layout` searches the TP/EP/PP layouts of the trainer
GPUs for the one that fits with the least model parallelism.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..guidance import LayerPolicy
from ..guidance.record import Coding
from ..model_config import PRESETS, from_hf
from ..modes import EnginePrecision, RunMode
from .architecture import Architecture
from .factories import resolve_model_config
from .job_layout import engine_instances, job_shape
from .plan_sglang import SGLangEngineGPU, sglang_engine_gpu

GiB, MiB = 1024**3, 1024**2
USABLE = 0.92  # of GPU memory: what the CUDA context, NCCL buffers and fragmentation leave
# Sparse guidance on the wire (guidance/record.py, the engine's defaults tau 2 and scale coding
# "lsb"): per row a float32 g, every block scale's last bit (1/16 bit per element), and per kept
# element a one-byte position gap plus its mantissa bit. The kept fraction is measured: 2.94 % of
# elements lie within 2 BF16 ulps of an E2M1 rounding boundary (bench/results/guidance_bytes_2026-11-30.md,
# row "sparse tau=2, scale LSBs": 0.343 bits per element at 2048 columns, which these give back:
# 32/2048 + 1/16 + 0.0294 x 9); for the tiny model's narrow sites they give 1.23 bits per element
# against the 1.25 its rollouts measured (bench/results/mismatch_tiny_sparse_2026-11-30.json).
SPARSE_KEPT = 0.0294
SPARSE_BITS_PER_KEPT = 9  # a one-byte gap (a gap of 255 or more takes another byte: rare at 3 %) + the bit


# -- the run's shape -------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    pp: int = 1
    etp: int = 1

    def __str__(self) -> str:
        return f"TP{self.tp} EP{self.ep} PP{self.pp} ETP{self.etp}"


def layout_errors(arch: Architecture, lay: Layout, trainer_gpus: int) -> list[str]:
    """Why this layout cannot run on `trainer_gpus` (empty: it can)."""
    errs = []
    if trainer_gpus % (lay.tp * lay.pp):
        errs.append(f"{trainer_gpus} trainer GPUs do not divide into TP{lay.tp} x PP{lay.pp}")
    elif (trainer_gpus // lay.pp) % (lay.ep * lay.etp):
        errs.append(f"EP{lay.ep} x ETP{lay.etp} does not divide the {trainer_gpus // lay.pp} GPUs of a pipeline stage")
    if arch.kv_heads % lay.tp and arch.kv_heads > 1:
        errs.append(f"TP{lay.tp} does not divide the {arch.kv_heads} KV heads")
    if arch.q_heads % lay.tp:
        errs.append(f"TP{lay.tp} does not divide the {arch.q_heads} attention heads")
    if arch.experts % lay.ep:
        errs.append(f"EP{lay.ep} does not divide the {arch.experts} experts")
    if arch.moe_ffn % (16 * lay.etp):
        errs.append(f"ETP{lay.etp} leaves expert shards that are not whole NVFP4 blocks")
    if arch.layers % lay.pp:
        errs.append(f"PP{lay.pp} does not divide the {arch.layers} layers")
    return errs


@dataclass(kw_only=True)
class Plan:
    """Bytes per GPU by item (trainer and engine), per host, per step (and the step's seconds on
    the network), and what does not fit."""

    arch: Architecture
    layout: Layout
    trainer_gpus: int
    engine_gpus: int
    dp: int
    expert_dp: int
    optimizer: str  # how the optimizer state is held, in words
    trainer: dict[str, float]
    engine: dict[str, float]
    traffic: dict[str, float]
    seconds: dict[str, float]  # the traffic's items, as time on the cluster's network
    host: dict[str, float]
    limits: dict[str, float]
    problems: list[str]
    sglang: SGLangEngineGPU | None = None  # the SGLang engine GPU's pool figures (rollout.backend=sglang)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def trainer_peak(self) -> float:
        return _peak(self.trainer)

    @property
    def engine_total(self) -> float:
        return sum(self.engine.values())


SYNC_BUCKET = "weight sync bucket (packed)"


def _peak(items: dict[str, float]) -> float:
    """The larger of the forward-backward and the weight-sync working sets."""
    sync_only = items.get(SYNC_BUCKET, 0.0)
    fwd_only = sum(v for k, v in items.items() if k.startswith(("activations", "logits", "QAT", "guidance")))
    static = sum(items.values()) - sync_only - fwd_only
    return static + max(sync_only, fwd_only)


def guidance_bytes_per_token(arch: Architecture, layer_count: int, coding: Coding | str = Coding.DENSE,
                             decoded: bool = False) -> float:
    """Guidance bytes per token for `layer_count` guided layers (guidance/record.py). Dense: per
    row a float32 global scale, an E4M3 scale per 16 elements and a mantissa bit per element
    (exact). Sparse, on the wire: per row the float32 g and a scale bit per 16 elements, and
    `SPARSE_BITS_PER_KEPT` for each of the `SPARSE_KEPT` elements near a rounding boundary (the
    measured fraction). `decoded`: the trainer's decoded form of sparse guidance, dense tensors
    plus known-bit and known-scale masks (guidance/rows.py)."""
    if Coding(coding) is Coding.DENSE:
        per_row = lambda c: 4 + c // 16 + c // 8
    elif decoded:
        per_row = lambda c: 4 + 2 * (c // 16) + 2 * (c // 8)
    else:
        per_row = lambda c: 4 + c / 128 + c * SPARSE_KEPT * SPARSE_BITS_PER_KEPT / 8
    return layer_count * sum(rows * per_row(cols) for rows, cols in arch.sites)


def expert_id_bytes(arch: Architecture) -> int:
    """Bytes of one routed expert id as the ids travel: the smallest integer type that holds them."""
    return 1 if arch.experts <= 256 else 2


def routed_expert_bytes_per_token(arch: Architecture) -> int:
    """Bytes per token of the routed expert ids (every MoE layer's top-k, uint8 or int16)."""
    return arch.moe_layers * arch.top_k * expert_id_bytes(arch)


KV_BLOCK = 16  # tokens per KV-cache block of the built-in engine (EngineConfig.block_size)


def kv_blocks(groups: int, group_size: int, prompt_tokens: int, new_tokens: int, block: int = KV_BLOCK) -> int:
    """KV-cache blocks `groups` groups of prompts of up to `prompt_tokens` tokens need at once,
    at their longest: the prompt's blocks once per group, each sample's own (the prompt's partial
    last block is copied per sample). A shorter prompt can need more: a sample owns
    ceil((p % block + new_tokens) / block) blocks, most where p % block is largest, so each
    term is its maximum over every prompt length up to prompt_tokens."""
    own = math.ceil((min(prompt_tokens, block - 1) + new_tokens) / block)
    return groups * (math.ceil(prompt_tokens / block) + group_size * own)


def engine_kv_blocks(cfg, engine_tp: int | None = None) -> int:
    """KV blocks an engine needs to hold its share of a step's groups at once (the built-in
    engine is built with that many, SGLang's pool capped at that many tokens); engine_tp: GPUs per
    engine (default dist.engine_tp; another one splits the same engine GPUs into other engines)."""
    rl = cfg.rl
    groups = math.ceil(rl.prompts_per_step / engine_instances(cfg, engine_tp))
    return kv_blocks(groups, rl.group_size, rl.max_prompt_tokens, rl.max_new_tokens)


def engine_tokens_needed(cfg, engine_tp: int | None = None) -> int:
    """Tokens an engine's share of a step's groups holds at once, at their longest, each prompt
    once per group (SGLang's radix cache shares it; one token per slot)."""
    rl = cfg.rl
    groups = math.ceil(rl.prompts_per_step / engine_instances(cfg, engine_tp))
    return groups * (rl.max_prompt_tokens + rl.group_size * rl.max_new_tokens)


def _guided_layers(policy: str, arch: Architecture, mode: RunMode, coding: Coding | str) -> int:
    """Layers whose guidance the trainer receives (a budget: as many as its bytes allow)."""
    if not mode.applies_guidance:
        return 0
    pol = LayerPolicy.parse(policy)
    if pol.kind == "budget":
        return min(arch.layers, int(pol.budget_bytes_per_token // guidance_bytes_per_token(arch, 1, coding)))
    return len(pol.select(arch.layers))


def gpu_counts(cfg) -> tuple[int, int]:
    """(trainer GPUs, engine GPUs) of the run: colocated is one GPU for both (engine GPUs 0);
    otherwise the cluster's GPUs, engine_nodes' (or dist.engine_ranks x dist.engine_tp of one
    node) serving (job_layout.job_shape; ValueError naming the settings that disagree)."""
    shape = job_shape(cfg)
    return shape.trainers, shape.engine_gpus


# -- what one trainer GPU holds ----------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """Parameters one trainer GPU of the fullest pipeline stage holds, by how they replicate."""

    dense: float  # over the DP ranks: attention, dense FFNs, routers, norms, embedding and head
    norms: float  # of which FP32 (Megatron keeps norm weights in float32)
    expert: float  # over the expert-DP ranks: the routed experts' shard
    fp4: float  # of both, at FP4 sites

    @property
    def total(self) -> float:
        return self.dense + self.expert


def held_params(arch: Architecture, lay: Layout) -> Held:
    """The parameters of the first (fullest) pipeline stage's layers on one GPU, dense leading
    layers included; the embedding and, when not tied or without PP, the output layer."""
    h = arch.hidden
    dense = expert = fp4 = 0.0
    stage_layers = math.ceil(arch.layers / lay.pp)
    for layer in range(stage_layers):
        ep_params, tp_params = arch.ffn_params(layer)
        dense += (arch.attn_params + tp_params) / lay.tp + arch.norm_params + (arch.experts * h if ep_params else 0)
        expert += ep_params / (lay.ep * lay.etp)
        fp4 += (arch.attn_params + tp_params) / lay.tp + ep_params / (lay.ep * lay.etp)
    dense += arch.vocab * h / lay.tp * (1 if lay.pp > 1 or arch.tie_embeddings else 2) + h
    return Held(dense=dense, norms=stage_layers * arch.norm_params + h, expert=expert, fp4=fp4)


def optimizer_bytes(held: Held, dp: int, expert_dp: int, distributed: bool, offload: bool,
                    device_main: bool = False) -> tuple[float, float]:
    """(GPU bytes, host bytes) of one rank's optimizer state under Megatron's optimizers: FP32
    main parameters (4 B per BF16 parameter; an FP32 parameter is its own main parameter) and
    AdamW's exp_avg and exp_avg_sq (8 B per parameter). Distributed: the rank holds 1/dp of the
    dense parameters' and 1/expert_dp of the experts'. Offloaded (HybridDeviceOptimizer, all of
    it, precision-aware as TRACE builds it): the host holds the FP32 masters, an FP32 copy of
    the gradients and the moments, 16 B per sharded parameter, and the GPU nothing; with
    `device_main` (precision-aware turned off) the GPU also keeps the FP32 main shard."""
    if not distributed:
        dp = expert_dp = 1
    shard = held.dense / dp + held.expert / expert_dp
    main = 4 * (shard - held.norms / dp)
    if offload:
        return (main if device_main else 0.0), 16 * shard
    return main + 8 * shard, 0.0


def zero_bytes(params: float, dp: int, stage: int, offload_optimizer: bool) -> dict[str, float]:
    """One GPU's trainer state under DeepSpeed ZeRO in bf16 mode, `params` parameters over `dp`
    data-parallel ranks (DeepSpeed's memory model): BF16 parameters (2 B; partitioned at stage 3),
    FP32 gradients (4 B; partitioned from stage 2), FP32 master parameters and AdamW's two
    moments (12 B; partitioned from stage 1; on the host with offload_optimizer)."""
    opt = 12 * params / (dp if stage >= 1 else 1)
    return {"parameters (BF16)": 2 * params / (dp if stage == 3 else 1),
            "gradients (FP32)": 4 * params / (dp if stage >= 2 else 1),
            "optimizer state (FP32 masters + AdamW moments)": 0.0 if offload_optimizer else opt,
            "host: offloaded optimizer state": opt if offload_optimizer else 0.0}


def grad_reduction_bytes(held: Held, dp: int, expert_dp: int, distributed: bool) -> float:
    """Bytes one GPU sends per step to reduce its gradients, as NCCL's ring algorithms send
    them: an all-reduce of the FP32 buffer over n ranks sends 2 (n-1)/n x 4 B per parameter;
    under the distributed optimizer a reduce-scatter of it and an all-gather of the updated
    parameters send (n-1)/n x (4 + 2) B per BF16 parameter (4 + 4 per FP32 one). Dense
    parameters over the DP ranks, experts over the expert-DP ranks."""
    def over(n: int, numel: float, fp32: float) -> float:
        share = (n - 1) / n
        return share * (6 * numel + 2 * fp32) if distributed else 2 * share * 4 * numel
    return over(dp, held.dense, held.norms) + over(expert_dp, held.expert, 0.0)


def link_bytes_per_s(cluster, within_node: bool) -> float:
    """One GPU's link each way: NVLink inside a node, the network between nodes."""
    return cluster.nvlink_gbs * 1e9 if within_node else cluster.network_gbps * 1e9 / 8


def make_plan(cfg, arch: Architecture, layout: Layout | None = None) -> Plan:
    """The plan of the run `cfg` (a TrainConfig) for `arch` under `layout` (default: cfg.dist's)."""
    dist, rl, cl, optim = cfg.dist, cfg.rl, cfg.cluster, cfg.optim
    lay = layout or Layout(dist.tp, dist.ep, dist.pp, dist.etp)
    trainer_gpus, engine_gpus = gpu_counts(cfg)
    colocated = engine_gpus == 0
    problems = layout_errors(arch, lay, trainer_gpus)
    dp = max(1, trainer_gpus // (lay.tp * lay.pp))
    expert_dp = max(1, trainer_gpus // (lay.pp * lay.ep * lay.etp))
    held = held_params(arch, lay)
    stage_layers = math.ceil(arch.layers / lay.pp)
    # the rank's samples (all packed up front, guidance included), then its largest micro-batch
    rank_tokens = math.ceil(rl.prompts_per_step * rl.group_size / dp) * (rl.max_prompt_tokens + rl.max_new_tokens)
    T = rank_tokens if not rl.max_tokens_per_microbatch else min(
        rank_tokens, max(rl.max_tokens_per_microbatch, rl.max_prompt_tokens + rl.max_new_tokens))
    guided = _guided_layers(rl.guide, arch, rl.mode, rl.coding)
    ids_stage = routed_expert_bytes_per_token(arch) * stage_layers / arch.layers
    opt_gpu, opt_host = optimizer_bytes(held, dp, expert_dp, optim.distributed, optim.cpu_offload,
                                        not optim.megatron.get("use_precision_aware_optimizer", True))
    fp4_engine = rl.mode.engine_precision is EnginePrecision.FP4
    packed_rank = held.fp4 * (0.5 + 1 / 16) + 2 * (held.total - held.fp4) if fp4_engine else 2 * held.total
    bucket = min(dist.sync_bucket_mb * MiB, packed_rank)
    trainer = {
        "parameters (BF16, norms FP32)": 2 * held.total + 2 * held.norms,
        "gradient buffer (FP32 main_grad)": 4 * held.total,
        "optimizer state (FP32 main params + AdamW moments)": opt_gpu,
    }
    zero = cfg.trainer.deepspeed.get("zero_optimization", {})
    zero_stage, zero_host = int(zero.get("stage", 0)), 0.0
    if cfg.trainer.backend == "deepspeed":  # ZeRO data parallelism over every trainer GPU (no TP / EP / PP)
        offload = zero.get("offload_optimizer", {}).get("device", "none") == "cpu"
        trainer = zero_bytes(held.total, dp, zero_stage, offload)
        zero_host = trainer.pop("host: offloaded optimizer state")
    if rl.mode.trainer_precision.quantizes:
        trainer["QAT weight copies + STE masks"] = 3 * held.fp4
    if rl.kl_coef:
        trainer["KL reference weights (BF16)"] = 2 * held.total / (
            dp if cfg.trainer.backend == "deepspeed" and zero_stage == 3 else 1)
    trainer["activations"] = _activation_bytes(arch, lay, T, stage_layers, dist.recompute)
    trainer["logits (FP32)"] = 3 * 4 * T * arch.vocab / lay.tp
    in_flight = min(lay.pp, math.ceil(rank_tokens / T))  # 1F1B keeps up to PP micro-batches alive
    trainer["guidance (micro-batches in flight)"] = in_flight * T * (
        guidance_bytes_per_token(arch, min(guided, stage_layers), rl.coding, decoded=True) + ids_stage)
    trainer[SYNC_BUCKET] = bucket

    # engine: one instance per dist.engine_tp GPUs (an engine rank), generating its share of the step
    instances = 1 if colocated else engine_instances(cfg)
    limits = {"gpu": cl.gpu_memory_gib * GiB * USABLE, "host": cl.host_memory_gib * GiB * USABLE}
    engine, engine_node, sglang = _engine_side(cfg, arch, guided, fp4_engine, colocated, limits["gpu"])
    traffic, seconds = _traffic(cfg, arch, held, dp, expert_dp, guided, fp4_engine, instances,
                                (trainer_gpus, engine_gpus))
    local_trainers = min(cl.gpus_per_node, trainer_gpus)
    host = {"trainer node: one sync bucket per rank": local_trainers * bucket}
    if optim.cpu_offload:
        host["trainer node: offloaded optimizer state"] = local_trainers * opt_host
    if zero_host:
        host["trainer node: offloaded optimizer state"] = local_trainers * zero_host
    host["trainer node: its ranks' rollout guidance"] = local_trainers * rank_tokens * (
        guidance_bytes_per_token(arch, min(guided, stage_layers), rl.coding) + ids_stage)
    host["engine node: its engines' recorded guidance"] = engine_node
    if sglang is not None and not colocated:  # SGLang's loader puts sliced weights together in host memory
        per_node = max(1, min(cl.gpus_per_node, engine_gpus) // dist.engine_tp)
        # trainer TP / expert-TP shards arrive rank after rank: up to the whole model; else the largest
        # weight cut by bucket size (the BF16 embedding or output layer)
        sliced = _packed_model(arch, fp4_engine) if lay.tp * lay.etp > 1 else 2 * arch.vocab * arch.hidden
        host["engine node: sliced weights put together, per SGLang engine rank"] = per_node * sliced
    problems += _shortfalls(cfg, arch, fp4_engine, _peak(trainer), engine, host, limits, colocated)
    if sglang is not None:
        fit = "" if colocated or not sglang.shortfalls else \
            f" ({_fitting_engine_tp(cfg, arch, fp4_engine, limits['gpu'])})"
        problems += sglang.problems + [p + fit for p in sglang.shortfalls]
    if arch.implemented:
        problems.append(f"{arch.name} cannot train with these backends yet: {arch.implemented}")
    if cfg.rollout.backend == "builtin" and dist.engine_tp > 1:
        problems.append(f"dist.engine_tp={dist.engine_tp}: the built-in engine runs on one GPU (engine tensor "
                        "parallelism runs on SGLang engines, rollout.backend=sglang)")
    how = ("distributed" if optim.distributed else "replicated") + (
        ", offloaded to the host" if optim.cpu_offload else "")
    if cfg.trainer.backend == "deepspeed":
        how = f"DeepSpeed ZeRO-{zero_stage}"
    return Plan(arch=arch, layout=lay, trainer_gpus=trainer_gpus, engine_gpus=engine_gpus, dp=dp, expert_dp=expert_dp,
                optimizer=how, trainer=trainer, engine=engine, traffic=traffic, seconds=seconds, host=host,
                limits=limits, problems=problems, sglang=sglang)


def _engine_side(cfg, arch: Architecture, guided: int, fp4_engine: bool, colocated: bool,
                 usable: float) -> tuple[dict, float, SGLangEngineGPU | None]:
    """One engine GPU's bytes (weights, KV cache, a received sync bucket; on SGLang its pool and
    workspace too, `plan_sglang`), the host bytes of an engine node's recorded guidance (wire form;
    fp4-qat records dense guidance to measure flips), and the SGLang engine GPU's figures (None
    for the built-in engine)."""
    rl, dist, cl = cfg.rl, cfg.dist, cfg.cluster
    _, engine_gpus = gpu_counts(cfg)
    kv_tokens = engine_kv_blocks(cfg) * KV_BLOCK
    recorded = _recorded_layers(rl, arch, guided)
    coding = rl.coding if rl.mode.applies_guidance else Coding.DENSE
    sglang = None
    if cfg.rollout.backend == "sglang":
        sglang = _sglang_gpu(cfg, arch, fp4_engine, dist.engine_tp, recorded > 0)
        engine = dict(sglang.items)
    else:
        engine = _engine_bytes(arch, fp4_engine, dist.engine_tp, kv_tokens)
    if not colocated:
        bucket = min(dist.sync_bucket_mb * MiB, sum(engine.values()))
        engine["weight sync bucket (received)"] = bucket
        if sglang is not None:  # SGLangEngine checks each bucket before the one before it goes
            engine["weight sync bucket (the next, being checked)"] = bucket
    per_node = max(1, min(cl.gpus_per_node, engine_gpus) // dist.engine_tp)
    return engine, per_node * kv_tokens * (guidance_bytes_per_token(arch, recorded, coding)
                                           + routed_expert_bytes_per_token(arch)), sglang


def _recorded_layers(rl, arch: Architecture, guided: int) -> int:
    """Layers whose guidance the engine records (fp4-qat records every layer to measure flips)."""
    if rl.mode.applies_guidance:
        return guided
    return arch.layers if rl.mode is RunMode.FP4_QAT and rl.measure_flips else 0


def _sglang_gpu(cfg, arch: Architecture, fp4: bool, engine_tp: int, guidance: bool) -> SGLangEngineGPU:
    """One GPU of an SGLang engine of `engine_tp` GPUs for this run (plan_sglang)."""
    return sglang_engine_gpu(arch, fp4=fp4, tp=engine_tp, options=cfg.rollout.sglang,
                             gpu_memory_gib=cfg.cluster.gpu_memory_gib,
                             tokens_needed=engine_tokens_needed(cfg, engine_tp),
                             tokens_asked=engine_kv_blocks(cfg, engine_tp) * KV_BLOCK, guidance=guidance)


def _packed_model(arch: Architecture, fp4: bool) -> float:
    """The whole model as the weight sync carries it: FP4 sites packed (codes + E4M3 scales), or BF16."""
    return arch.fp4_params * (0.5 + 1 / 16) + 2 * (arch.num_params - arch.fp4_params) if fp4 else 2 * arch.num_params


def _traffic(cfg, arch: Architecture, held: Held, dp: int, expert_dp: int, guided: int, fp4_engine: bool,
             instances: int, gpus: tuple[int, int]) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes moved per step and their seconds on the network. Trainers -> engines: every engine
    instance receives the packed model (each of its GPUs its shard), guidance and routed ids come
    back once per token (prompts once per group), spread over the sending and receiving GPUs;
    inside one node over NVLink, else over the network. Colocated: in-process copies, none."""
    rl, cl = cfg.rl, cfg.cluster
    trainer_gpus, engine_gpus = gpus
    colocated = engine_gpus == 0
    packed = _packed_model(arch, fp4_engine)
    step_tokens = rl.prompts_per_step * (rl.max_prompt_tokens + rl.group_size * rl.max_new_tokens)
    coding = Coding(rl.coding).value if guided else "none"
    moved = {f"weight sync to the engines ({'packed FP4' if fp4_engine else 'BF16'})": packed * instances,
             f"guidance to the trainers ({coding})": step_tokens * guidance_bytes_per_token(arch, guided, rl.coding),
             f"routed expert ids ({'uint8' if expert_id_bytes(arch) == 1 else 'int16'})":
                 step_tokens * routed_expert_bytes_per_token(arch)}
    moved = {k: 0.0 if colocated else v for k, v in moved.items()}
    across = link_bytes_per_s(cl, within_node=cl.nodes == 1)
    seconds = {k: v / (max(1, min(trainer_gpus, engine_gpus)) * across) for k, v in moved.items()}
    name = ("gradient reduce-scatter + parameter all-gather" if cfg.optim.distributed else "gradient all-reduce")
    name += ", per GPU"
    moved[name] = grad_reduction_bytes(held, dp, expert_dp, cfg.optim.distributed)
    # Megatron's rank order (TP, then DP or EP x expert-DP, PP outermost): a stage's GPUs are consecutive
    seconds[name] = moved[name] / link_bytes_per_s(cl, within_node=trainer_gpus // cfg.dist.pp <= cl.gpus_per_node)
    return moved, seconds


def _shortfalls(cfg, arch: Architecture, fp4_engine: bool, trainer_peak: float, engine: dict[str, float],
                host: dict[str, float], limits: dict[str, float], colocated: bool) -> list[str]:
    """What does not fit: the trainer GPU (with a colocated engine), the engine GPU (naming an
    engine TP that fits), a trainer or engine node's host memory."""
    cl = cfg.cluster
    problems = []
    t_peak = trainer_peak + (sum(engine.values()) if colocated else 0)
    if t_peak > limits["gpu"]:
        problems.append(f"trainer GPU needs {t_peak / GiB:.1f} GiB, {(t_peak - limits['gpu']) / GiB:.1f} GiB more "
                        f"than the {limits['gpu'] / GiB:.1f} GiB usable of {cl.gpu_memory_gib:g} GiB")
    e = sum(engine.values())
    if not colocated and e > limits["gpu"]:
        problems.append(f"engine GPU needs {e / GiB:.1f} GiB, {(e - limits['gpu']) / GiB:.1f} GiB more than the "
                        f"{limits['gpu'] / GiB:.1f} GiB usable; " + _fitting_engine_tp(cfg, arch, fp4_engine,
                                                                                        limits["gpu"]))
    for what in ("trainer node", "engine node"):
        x = sum(v for k, v in host.items() if k.startswith(what))
        if x > limits["host"]:
            problems.append(f"{what} host memory: {x / GiB:.0f} GiB, {(x - limits['host']) / GiB:.0f} GiB more than "
                            f"usable of {cl.host_memory_gib:g} GiB")
    return problems


def _fitting_engine_tp(cfg, arch: Architecture, fp4: bool, usable: float) -> str:
    """Names the smallest engine TP above dist.engine_tp that fits the same engine GPUs."""
    _, engine_gpus = gpu_counts(cfg)
    fitting = [t for t in (2, 4, 8, 16) if cfg.dist.engine_tp < t <= engine_gpus and engine_gpus % t == 0
               and _engine_fits(cfg, arch, fp4, t, usable)]
    if not fitting:
        return "no engine_tp fits these engine GPUs"
    return f"dist.engine_tp={fitting[0]} fits" + (" (SGLang engines)" if cfg.rollout.backend == "builtin" else "")


def _engine_fits(cfg, arch: Architecture, fp4: bool, engine_tp: int, usable: float) -> bool:
    """Whether an engine of `engine_tp` GPUs fits one engine GPU (SGLang: nothing it refuses either)."""
    if cfg.rollout.backend == "sglang":
        if engine_tp % int(cfg.rollout.sglang.get("ep_size", 1)):
            return False
        gpu = _sglang_gpu(cfg, arch, fp4, engine_tp, _recorded_layers(
            cfg.rl, arch, _guided_layers(cfg.rl.guide, arch, cfg.rl.mode, cfg.rl.coding)) > 0)
        return not gpu.problems and not gpu.shortfalls and gpu.total <= usable
    return sum(_engine_bytes(arch, fp4, engine_tp, engine_kv_blocks(cfg, engine_tp) * KV_BLOCK).values()) <= usable


def _engine_bytes(arch: Architecture, fp4: bool, engine_tp: int, kv_tokens: int) -> dict[str, float]:
    """One engine GPU: its shard of the weights (FP4 sites packed, or BF16; the rest BF16, norms
    and the router float32) and of the KV cache for `kv_tokens` token slots (FP4: codes, E4M3
    scales and a float32 scale per token and head)."""
    L = arch.layers
    fp4_all = arch.fp4_params
    norms = L * arch.norm_params + arch.hidden + arch.moe_layers * arch.experts * arch.hidden  # held in float32
    other = arch.num_params - fp4_all
    kv_per_token = L * arch.kv_bytes_per_token(fp4)
    return {"weights (FP4 codes + scales)" if fp4 else "weights (BF16)":
            ((fp4_all * (0.5 + 1 / 16) if fp4 else 2 * fp4_all) + 2 * other + 2 * norms) / engine_tp,
            "KV cache": kv_tokens * kv_per_token / engine_tp}


def _activation_bytes(arch: Architecture, lay: Layout, T: int, layers: int, recompute: str) -> float:
    """BF16 bytes autograd keeps for one micro-batch of T tokens on one GPU: an estimate of our
    layer (norm inputs and outputs, residuals, QKV and attention outputs with flash attention,
    the fake-quantized copy of each FP4 input, router logits and probabilities in FP32, and per
    routed row its input, gate/up, SwiGLU and fc2 copies). Sequence parallelism divides tokens
    and heads by TP; expert-TP gathers rows and splits their width. recompute: "full" keeps
    only each layer's input (plus one layer in flight), "selective" recomputes the MoE part."""
    h, f, tp = arch.hidden, arch.moe_ffn, lay.tp
    tokens = T / tp  # this GPU's sequence-parallel share
    attention = tokens * (6 * h + 3 * (arch.attn_out_width + arch.kv_width) + 2 * arch.attn_out_width
                          + 4 * arch.experts)
    rows = tokens * arch.top_k * lay.etp  # routed rows this GPU computes (balanced routing)
    moe = rows * (2 * h + 5 * f / lay.etp)
    if recompute == "full":
        return 2 * (layers * tokens * h + attention + moe)
    if recompute == "selective":
        return 2 * (layers * (attention + tokens * h) + moe)
    return 2 * layers * (attention + moe)


def choose_layout(cfg, arch: Architecture) -> list[Plan]:
    """Every TP/EP/PP layout of the trainer GPUs (ETP 1), the fitting ones first, those with the
    least tensor and pipeline parallelism, then the least memory, first."""
    plans = []
    n, _ = gpu_counts(cfg)
    for tp in (1, 2, 4, 8):
        for pp in (d for d in range(1, n + 1) if n % d == 0):
            for ep in (d for d in range(1, n // pp + 1) if (n // pp) % d == 0):
                lay = Layout(tp, ep, pp, 1)
                if layout_errors(arch, lay, n):
                    continue
                plans.append(make_plan(cfg, arch, lay))
    return sorted(plans, key=lambda p: (not p.fits, p.layout.tp * p.layout.pp, p.trainer_peak))


def architecture(cfg) -> Architecture:
    """The run's model for planning: the one training would build, or would refuse to build yet
    (a preset or an HF config.json of the DeepSeek-V3 family)."""
    if cfg.model.hf:
        model_cfg = from_hf(json.loads(Path(cfg.model.hf, "config.json").read_text()))
    elif cfg.model.megatron:
        model_cfg = resolve_model_config(cfg.model)
    else:
        model_cfg = PRESETS[cfg.model.preset]
    # the Megatron trainer with the built-in engine builds the DeepSeek-V3 family, with SGLang its
    # DeepSeek-V3 pieces (what SGLang builds, Megatron does too); DeepSpeed neither yet
    part = {"builtin": "engine", "sglang": "sglang"}.get(cfg.rollout.backend, "all")
    part = part if cfg.trainer.backend == "megatron" else "all"
    return Architecture.from_model_config(cfg.model.hf or cfg.model.megatron or cfg.model.preset, model_cfg, part)


def format_plan(plan: Plan) -> str:
    """The plan as text tables, in GiB (MiB for a small model); traffic with its seconds."""
    big = max(plan.trainer_peak, plan.engine_total, *plan.host.values()) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", MiB)

    def rows(items, seconds=None):
        return "\n".join(f"  {k:<56} {v / div:10.3f}" + (f" {seconds[k]:9.3f} s" if seconds else "")
                         for k, v in items.items())

    a, lay = plan.arch, plan.layout
    lines = [f"model {a.name}: {a.num_params / 1e9:.3f} B parameters, {a.layers} layers, "
             f"{a.experts} experts top-{a.top_k}",
             f"trainer: {plan.trainer_gpus} GPU(s), {lay}, DP{plan.dp} (experts: DP{plan.expert_dp}), optimizer "
             f"{plan.optimizer}; engines: "
             + (f"{plan.engine_gpus} GPU(s)" if plan.engine_gpus else "colocated on the trainer's GPU"),
             f"trainer GPU ({unit})", rows(plan.trainer),
             f"  {'peak (forward-backward or weight sync)':<56} {plan.trainer_peak / div:10.3f}",
             f"engine GPU ({unit})", rows(plan.engine), f"  {'total':<56} {plan.engine_total / div:10.3f}",
             *([f"  {plan.sglang.summary()}"] if plan.sglang else []),
             f"per RL step ({unit} moved, seconds at the link rate)", rows(plan.traffic, plan.seconds),
             f"host memory per node ({unit})", rows(plan.host),
             f"usable: {plan.limits['gpu'] / GiB:.1f} GiB per GPU ({USABLE:.0%} of it), "
             f"{plan.limits['host'] / GiB:.0f} GiB per host"]
    lines += ["FITS" if plan.fits else "DOES NOT FIT:"] + [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    """The plan as JSON-ready values (`trace-rl plan --json`)."""
    return {"model": plan.arch.name, "params": plan.arch.num_params, "layout": dataclasses.asdict(plan.layout),
            "trainer_gpus": plan.trainer_gpus, "engine_gpus": plan.engine_gpus, "dp": plan.dp,
            "expert_dp": plan.expert_dp, "optimizer": plan.optimizer, "trainer_bytes": plan.trainer,
            "trainer_peak_bytes": plan.trainer_peak, "engine_bytes": plan.engine, "traffic_bytes": plan.traffic,
            "traffic_seconds": plan.seconds, "host_bytes": plan.host, "fits": plan.fits, "problems": plan.problems,
            "sglang": None if plan.sglang is None else {k: v for k, v in dataclasses.asdict(plan.sglang).items()
                                                         if k not in ("items", "problems", "shortfalls")}}
