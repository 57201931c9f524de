"""`trace-rl plan`: per-GPU memory and per-step traffic of a run, before it runs.

From the run's own config (model, `dist` layout, `rl` batch shape, `cluster` machines) it counts
what each rank holds, as this code base holds it:

- trainer GPU (the pipeline stage holding the most): BF16 parameters and gradients, FP32
  masters and AdamW moments (`rl/optim.py`, not sharded over data-parallel ranks), the FP32
  gradient copies of the optimizer step, QAT's dequantized weight copies and STE masks kept for
  backward, the KL reference's weights, activations of the rank's one micro-batch (all its
  samples packed, sequence-parallel under TP; with recompute only layer inputs plus one layer),
  the logits, and the guidance of the micro-batches in flight;
- engine GPU: FP4 weights (codes + E4M3 block scales) or BF16, and the FP4 KV cache of a
  step's in-flight samples (prompts stored once per group);
- host memory per node: trainer rank 0 gathers the full BF16 weights for the sync and packs
  them; guidance waits on the host (records leave the engine's GPU layer by layer, and a
  trainer moves one micro-batch's to its GPU at a time);
- per step: weight-sync bytes (rank 0 sends the packed weights to every engine rank) and
  guidance bytes.

Activation counts are estimates (what autograd saves per token in our layer, in BF16); the rest
is exact. A layout that does not fit is refused with the shortfall. `choose_layout` searches the
TP/EP/PP layouts of the trainer GPUs for the one that fits with the least model parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..guidance import LayerPolicy
from ..modes import EnginePrecision, RunMode
from .architecture import PLAN_ONLY, Architecture
from .factories import resolve_model_config

GiB = 1024**3
USABLE = 0.92  # of GPU memory: what the CUDA context, NCCL buffers and fragmentation leave


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
    """Bytes per GPU by item (trainer and engine), bytes per step, and what does not fit."""

    arch: Architecture
    layout: Layout
    trainer_gpus: int
    engine_gpus: int
    trainer: dict[str, float]
    engine: dict[str, float]
    traffic: dict[str, float]
    host: dict[str, float]
    limits: dict[str, float]
    problems: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def trainer_peak(self) -> float:
        return _peak(self.trainer)

    @property
    def engine_total(self) -> float:
        return sum(self.engine.values())


def _peak(items: dict[str, float]) -> float:
    """The larger of the forward-backward and the optimizer-step working sets."""
    step_only = items.get("optimizer step: FP32 gradient copies", 0.0)
    fwd_only = sum(v for k, v in items.items() if k.startswith(("activations", "logits", "QAT", "guidance")))
    static = sum(items.values()) - step_only - fwd_only
    return static + max(step_only, fwd_only)


def guidance_bytes_per_token(arch: Architecture, layer_count: int, decoded_sparse: bool = False) -> float:
    """Guidance bytes per token for `layer_count` guided layers: dense records (per row a float32
    global scale, an E4M3 scale per 16 elements and a mantissa bit per element). Sparse records
    carry fewer (only near-tie elements' bits); the plan counts them as dense, an upper bound.
    `decoded_sparse`: the trainer's decoded form of sparse guidance, which adds known-bit and
    known-scale masks (guidance.rows)."""
    h = arch.hidden
    head = arch.kv_width // (2 * arch.kv_heads)
    sites = [(1, h), (1, arch.attn_out_width), (1, h), (arch.top_k, arch.moe_ffn), (arch.kv_heads, head),
             (arch.kv_heads, head)]
    per_row = (lambda c: 4 + 2 * (c // 16) + 2 * (c // 8)) if decoded_sparse else (lambda c: 4 + c // 16 + c // 8)
    return layer_count * sum(rows * per_row(cols) for rows, cols in sites)


def routed_expert_bytes_per_token(arch: Architecture) -> int:
    """Bytes per token of the routed expert ids the engine records (int64, every MoE layer)."""
    return arch.moe_layers * arch.top_k * 8  # int64 ids, as the engine records them


KV_BLOCK = 16  # tokens per KV-cache block of the built-in engine (EngineConfig.block_size)


def kv_blocks(groups: int, group_size: int, prompt_tokens: int, new_tokens: int, block: int = KV_BLOCK) -> int:
    """KV-cache blocks `groups` groups need at once, at their longest: the prompt's blocks once
    per group, each sample's own (the prompt's partial last block is copied per sample)."""
    own = math.ceil((prompt_tokens + new_tokens) / block) - prompt_tokens // block
    return groups * (math.ceil(prompt_tokens / block) + group_size * own)


def engine_kv_blocks(cfg, engine_tp: int | None = None) -> int:
    """KV blocks an engine needs to hold its share of a step's groups at once (the built-in
    engine is built with that many); engine_tp: GPUs per engine (default dist.engine_tp)."""
    _, engines = gpu_counts(cfg)
    instances = max(1, engines // (engine_tp or cfg.dist.engine_tp))
    rl = cfg.rl
    return kv_blocks(math.ceil(rl.prompts_per_step / instances), rl.group_size, rl.max_prompt_tokens, rl.max_new_tokens)


def _guided_layers(policy: str, arch: Architecture, mode: RunMode) -> int:
    """Layers whose guidance the trainer receives (a budget: as many as its bytes allow)."""
    if not mode.applies_guidance:
        return 0
    pol = LayerPolicy.parse(policy)
    if pol.kind == "budget":
        return min(arch.layers, int(pol.budget_bytes_per_token // guidance_bytes_per_token(arch, 1)))
    return len(pol.select(arch.layers))


def gpu_counts(cfg) -> tuple[int, int]:
    """(trainer GPUs, engine GPUs) of the run: colocated is one GPU for both (engine GPUs 0);
    otherwise the cluster's GPUs, engine_nodes' (or dist.engine_ranks of one node) serving."""
    dist, cl = cfg.dist, cfg.cluster
    if dist.engine_ranks == 0 and cl.engine_nodes == 0:
        return 1, 0
    engines = cl.engine_nodes * cl.gpus_per_node if cl.engine_nodes else dist.engine_ranks
    if cl.engine_nodes and dist.engine_ranks and dist.engine_ranks != engines:
        raise ValueError(f"config: dist.engine_ranks={dist.engine_ranks} disagrees with cluster.engine_nodes x "
                         f"gpus_per_node = {engines}")
    trainers = cl.nodes * cl.gpus_per_node - engines
    if trainers < 1:
        raise ValueError(f"config: {engines} engine GPUs leave no trainer GPU of cluster.nodes x gpus_per_node")
    return trainers, engines


def make_plan(cfg, arch: Architecture, layout: Layout | None = None) -> Plan:
    """The plan of the run `cfg` (a TrainConfig) for `arch` under `layout` (default: cfg.dist's)."""
    dist, rl, cl = cfg.dist, cfg.rl, cfg.cluster
    lay = layout or Layout(dist.tp, dist.ep, dist.pp, dist.etp)
    trainer_gpus, engine_gpus = gpu_counts(cfg)
    colocated = engine_gpus == 0
    problems = layout_errors(arch, lay, trainer_gpus)
    dp = max(1, trainer_gpus // (lay.tp * lay.pp))
    h, L = arch.hidden, arch.layers

    # parameters of the fullest pipeline stage, on one GPU
    stage_layers = math.ceil(L / lay.pp)
    dense = expert = fp4 = 0.0
    for layer in range(stage_layers):  # the first stage's layers (dense leading layers included)
        ep_params, tp_params = arch.ffn_params(layer)
        dense += (arch.attn_params + tp_params) / lay.tp + arch.norm_params + (arch.experts * h if ep_params else 0)
        expert += ep_params / (lay.ep * lay.etp)
        fp4 += (arch.attn_params + tp_params) / lay.tp + ep_params / (lay.ep * lay.etp)
    ends = arch.vocab * h / lay.tp * (1 if lay.pp > 1 or arch.tie_embeddings else 2) + h
    params = dense + expert + ends
    # the rank's samples (all packed up front, guidance included), then its largest micro-batch
    rank_tokens = math.ceil(rl.prompts_per_step * rl.group_size / dp) * (rl.max_prompt_tokens + rl.max_new_tokens)
    T = rank_tokens if not rl.max_tokens_per_microbatch else min(
        rank_tokens, max(rl.max_tokens_per_microbatch, rl.max_prompt_tokens + rl.max_new_tokens))
    guided = _guided_layers(rl.guide, arch, rl.mode)
    norms_stage = stage_layers * arch.norm_params + h  # Megatron keeps norm weights in float32
    trainer = {
        "parameters (BF16, norms FP32)": 2 * params + 2 * norms_stage,
        "gradients (as the parameters)": 2 * params + 2 * norms_stage,
        "FP32 masters + AdamW moments": 12 * params,
        "optimizer step: FP32 gradient copies": 4 * params,
    }
    if rl.mode.trainer_precision.quantizes:
        trainer["QAT weight copies + STE masks"] = 3 * fp4
    if rl.kl_coef:
        trainer["KL reference weights (BF16)"] = 2 * params
    trainer["activations"] = _activation_bytes(arch, lay, T, stage_layers, dist.recompute)
    trainer["logits (FP32)"] = 3 * 4 * T * arch.vocab / lay.tp
    guidance_per_token = (guidance_bytes_per_token(arch, min(guided, stage_layers), rl.coding == "sparse")
                          + routed_expert_bytes_per_token(arch) * stage_layers / L)
    in_flight = min(lay.pp, math.ceil(rank_tokens / T))  # 1F1B keeps up to PP micro-batches alive
    trainer["guidance (micro-batches in flight)"] = in_flight * T * guidance_per_token

    # engine: one instance per dist.engine_tp GPUs, generating its share of the step
    etp = dist.engine_tp
    instances = 1 if colocated else max(1, engine_gpus // etp)
    fp4_all = arch.fp4_params
    other = arch.num_params - fp4_all
    fp4_engine = rl.mode.engine_precision is EnginePrecision.FP4
    kv_tokens = engine_kv_blocks(cfg) * KV_BLOCK
    recorded = guided if rl.mode.applies_guidance else (L if rl.mode is RunMode.FP4_QAT and rl.measure_flips else 0)
    engine = _engine_bytes(arch, fp4_engine, etp, kv_tokens)
    packed = fp4_all * (0.5 + 1 / 16) + 2 * other if fp4_engine else 2 * arch.num_params
    step_tokens = rl.prompts_per_step * rl.max_prompt_tokens + rl.prompts_per_step * rl.group_size * rl.max_new_tokens
    traffic = {
        "weight gather to trainer rank 0": 2 * arch.num_params * (0 if trainer_gpus == 1 else 1),
        "weight sync, rank 0 to the engines": packed * (instances if not colocated else 0),
        "guidance streamed to trainers": step_tokens * (guidance_bytes_per_token(arch, guided)
                                                        + routed_expert_bytes_per_token(arch)) * (not colocated),
    }
    limits = {"gpu": cl.gpu_memory_gib * GiB * USABLE, "host": cl.host_memory_gib * GiB * USABLE}
    t_peak = _peak(trainer) + (sum(engine.values()) if colocated else 0)
    if t_peak > limits["gpu"]:
        problems.append(f"trainer GPU needs {t_peak / GiB:.1f} GiB, {(t_peak - limits['gpu']) / GiB:.1f} GiB more "
                        f"than the {limits['gpu'] / GiB:.1f} GiB usable of {cl.gpu_memory_gib:g} GiB")
    e = sum(engine.values())
    if not colocated and e > limits["gpu"]:
        fitting = [t for t in (2, 4, 8, 16) if t > etp and t <= engine_gpus and engine_gpus % t == 0 and sum(
            _engine_bytes(arch, fp4_engine, t, engine_kv_blocks(cfg, t) * KV_BLOCK).values()) <= limits["gpu"]]
        problems.append(f"engine GPU needs {e / GiB:.1f} GiB, {(e - limits['gpu']) / GiB:.1f} GiB more than the "
                        f"{limits['gpu'] / GiB:.1f} GiB usable; "
                        + (f"dist.engine_tp={fitting[0]} fits" if fitting else "no engine_tp fits these engine GPUs"))
    # host memory per node: guidance waits there (records leave the engine's GPU layer by layer)
    local_trainers, local_engines = min(cl.gpus_per_node, trainer_gpus), min(cl.gpus_per_node, engine_gpus)
    host = {"trainer node: rank 0's full BF16 weights + packed copy": 2 * arch.num_params + packed,
            "trainer node: its ranks' rollout guidance": local_trainers * rank_tokens * guidance_per_token,
            "engine node: its engines' recorded guidance": max(1, local_engines // etp) * kv_tokens * (
                guidance_bytes_per_token(arch, recorded) + routed_expert_bytes_per_token(arch))}
    trainer_node = sum(v for k, v in host.items() if k.startswith("trainer"))
    for what, x in (("trainer node", trainer_node),
                    ("engine node", host["engine node: its engines' recorded guidance"])):
        if x > limits["host"]:
            problems.append(f"{what} host memory: {x / GiB:.0f} GiB, {(x - limits['host']) / GiB:.0f} GiB more than "
                            f"usable of {cl.host_memory_gib:g} GiB" + (" (the weight sync gathers the full model on "
                            "rank 0; sharded sync is not built yet)" if what == "trainer node" else ""))
    if arch.implemented:
        problems.append(f"{arch.name} is plan-only: {arch.implemented}")
    return Plan(arch=arch, layout=lay, trainer_gpus=trainer_gpus, engine_gpus=engine_gpus, trainer=trainer,
                engine=engine, traffic=traffic, host=host, limits=limits, problems=problems)


def _engine_bytes(arch: Architecture, fp4: bool, engine_tp: int, kv_tokens: int) -> dict[str, float]:
    """One engine GPU: its shard of the weights (FP4 sites packed, or BF16; the rest BF16, norms
    and the router float32) and of the KV cache for `kv_tokens` token slots (FP4: codes, E4M3
    scales and a float32 scale per token and head)."""
    L = arch.layers
    fp4_all = arch.fp4_params
    norms = L * arch.norm_params + arch.hidden + arch.moe_layers * arch.experts * arch.hidden  # held in float32
    other = arch.num_params - fp4_all
    kv_per_token = L * (arch.kv_width * (0.5 + 1 / 16) + 2 * arch.kv_heads * 4 if fp4 else arch.kv_width * 2)
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
    """The run's model for planning: a plan-only preset, or the one training would build."""
    if cfg.model.preset in PLAN_ONLY and not (cfg.model.hf or cfg.model.megatron):
        return PLAN_ONLY[cfg.model.preset]
    return Architecture.from_model_config(cfg.model.hf or cfg.model.megatron or cfg.model.preset,
                                          resolve_model_config(cfg.model))


def format_plan(plan: Plan) -> str:
    """The plan as text tables, in GiB (MiB for a small model)."""
    big = max(plan.trainer_peak, plan.engine_total, *plan.host.values()) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", 2**20)

    def rows(items):
        return "\n".join(f"  {k:<48} {v / div:10.3f}" for k, v in items.items())

    a, lay = plan.arch, plan.layout
    dp = max(1, plan.trainer_gpus // (lay.tp * lay.pp))
    lines = [f"model {a.name}: {a.num_params / 1e9:.3f} B parameters, {a.layers} layers, "
             f"{a.experts} experts top-{a.top_k}",
             f"trainer: {plan.trainer_gpus} GPU(s), {lay}, DP{dp}; engines: "
             + (f"{plan.engine_gpus} GPU(s)" if plan.engine_gpus else "colocated on the trainer's GPU"),
             f"trainer GPU ({unit})", rows(plan.trainer),
             f"  {'peak (forward-backward or optimizer step)':<48} {plan.trainer_peak / div:10.3f}",
             f"engine GPU ({unit})", rows(plan.engine), f"  {'total':<48} {plan.engine_total / div:10.3f}",
             f"per RL step ({unit} moved)", rows(plan.traffic),
             f"host memory ({unit})", rows(plan.host),
             f"usable: {plan.limits['gpu'] / GiB:.1f} GiB per GPU ({USABLE:.0%} of it), "
             f"{plan.limits['host'] / GiB:.0f} GiB per host"]
    lines += ["FITS" if plan.fits else "DOES NOT FIT:"] + [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    """The plan as JSON-ready values (`trace-rl plan --json`)."""
    return {"model": plan.arch.name, "params": plan.arch.num_params, "layout": dataclasses.asdict(plan.layout),
            "trainer_gpus": plan.trainer_gpus, "engine_gpus": plan.engine_gpus, "trainer_bytes": plan.trainer,
            "trainer_peak_bytes": plan.trainer_peak, "engine_bytes": plan.engine, "traffic_bytes": plan.traffic,
            "host_bytes": plan.host, "fits": plan.fits, "problems": plan.problems}
