"""`trace-rl plan` for SGLang engines (`rollout.backend=sglang`): one engine GPU as SGLang 0.5.17
fills it, with TRACE's `trace_fp4` plugin (sglang_rollout/sglang).

- **Weights** of SGLang's Qwen3-MoE under the engine's tp_size (`dist.engine_tp`): q/k/v/o, the
  embedding and the head split over TP (KV heads replicated where TP exceeds them; the vocabulary
  padded to 64), the experts over SGLang's ep_size (`rollout.sglang={ep_size: M}`, M dividing
  tp_size) and each expert's width over tp / ep, so an expert GPU holds experts / ep of width
  moe_ffn x ep / tp; norms (FP32, as TRACE's numerics.py gives them to SGLang) and routers (BF16)
  whole on every GPU. FP4 sites hold codes + E4M3 block scales, from the engine's start: TRACE
  starts SGLang on dummy weights and its quantization method creates FP4 sites packed
  (sglang_rollout/sglang/quant.py `packed_at_start`), so no BF16 shard is ever held.
- **KV pool**, sized as SGLang sizes it: the pool's budget is what is free after the weights
  minus (1 - mem_fraction_static) of what was free before them, i.e. mem_fraction_static x the
  GPU's memory minus the weights (mem_cache/kv_cache_configurator.py:1614-1635), divided by
  SGLang's bytes per token (model_executor/pool_configurator.py:291-296): kv_cache_dtype stays
  "auto", so SGLang counts BF16 cells (mem_cache/kv_cache_dtype.py:42), although TRACE's pool
  stores NVFP4 (codes, E4M3 block scales, an FP32 global scale per token and KV head:
  sglang_rollout/sglang/kv_cache.py). Under MLA (DeepSeek-V3 family) TRACE's plugin makes SGLang
  count TRACE's latent cells (sglang_rollout/sglang/mla.py: 420 B per token and layer at
  DeepSeek-V3's shape, against 1152 in BF16). The tokens are capped at max_total_tokens
  (kv_cache_configurator.py:1690-1705), which TRACE sets to the step's in-flight samples
  (`engine_kv_blocks`). mem_fraction_static's default is SGLang's (`default_mem_fraction_static`).
- **Workspace**: activations, CUDA graphs and the processes' CUDA contexts, measured on an H200
  (`workspace_bytes`, bench/results/sglang_workspace_2026-12-02_h200.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .architecture import Architecture

GiB = 1024**3
MiB = 1024**2
# The workspace of one SGLang engine GPU beyond its weights and KV pool (activations, CUDA graphs,
# the CUDA contexts), measured on an H200 (bench/sglang_workspace.py, 2026-12-02) at Qwen3-30B-A3B's
# hidden size 2048 with SGLang's 8192-token chunked prefill: 3.31 GiB with decode CUDA graphs
# (FP4 and BF16 alike), 2.34 GiB without (FP4 recording guidance; 2.29 GiB at 12 layers: it does
# not grow with depth). Rounded up here; other shapes scale by hidden x chunk (workspace_bytes).
WORKSPACE_BYTES = {True: 3.4 * GiB, False: 2.4 * GiB}  # by CUDA graphs on
WORKSPACE_SHAPE = 2048 * 8192  # hidden x chunked-prefill tokens of that measurement
VOCAB_PADDING = 64  # SGLang pads the vocabulary to a multiple of this (layers/vocab_parallel_embedding.py:48)
MOE_PADDING = 32  # each moe-TP rank's expert width a multiple of this, else SGLang pads (TRACE refuses)


def prefill_graph_sizes(max_bs: int) -> list[int]:
    """SGLang's prefill CUDA-graph token counts up to max_bs (server_args.py:4990-5007)."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return [s for s in sizes if s <= max_bs]


def workspace_bytes(arch: Architecture, graphs: bool, chunk: int) -> float:
    """An engine GPU's workspace: the measured figure (WORKSPACE_BYTES) scaled by hidden x chunked
    prefill tokens where they exceed the measurement's (prefill activations grow with both), never below it."""
    return WORKSPACE_BYTES[graphs] * max(1.0, arch.hidden * chunk / WORKSPACE_SHAPE)


def chunked_prefill(gpu_memory_gib: float) -> int:
    """SGLang 0.5.17's default chunked_prefill_size for a GPU of this memory (server_args.py:4635-4690)."""
    mem = gpu_memory_gib * 1024
    return 2048 if mem < 35 * 1024 else 4096 if mem < 60 * 1024 else 8192 if mem < 160 * 1024 else 16384


def default_mem_fraction_static(gpu_memory_gib: float, tp_size: int, cuda_graphs: bool,
                                chunked_prefill_size: int | None = None, max_total_tokens: int | None = None) -> float:
    """mem_fraction_static as SGLang 0.5.17 chooses it when it is not given, on CUDA, for one
    engine (no PP, DP attention, DeepEP, speculative decoding or multimodal encoder):
    server_args.py:4607-4788 (_handle_gpu_memory_settings) and 4882-4922 (reserve_for_graph_mb).
    By the GPU's memory, a chunked prefill size and a decode CUDA-graph batch; the reserve is
    512 MiB + 1.5 MiB per prefill token + 128 MiB per TP rank + the graphs' (2 MiB per decode
    batch, 8 MiB per prefill graph), at least 10 GiB above 60 GiB; the fraction is what remains,
    rounded to 3 digits. `cuda_graphs`: False when TRACE disables them (guidance capture)."""
    mem = gpu_memory_gib * 1024  # MiB, as get_device_memory_capacity reports it
    # the decode graphs' max batch by memory (server_args.py:4635-4690)
    if mem < 20 * 1024:
        max_bs = 8
    elif mem < 35 * 1024:
        max_bs = 24 if tp_size < 4 else 80
    elif mem < 60 * 1024:
        max_bs = 32 if tp_size < 4 else 160
    else:
        max_bs = (256 if tp_size < 4 else 512) if mem < 160 * 1024 else 512
    chunk = chunked_prefill_size or chunked_prefill(gpu_memory_gib)
    reserved = 512 + max(chunk, 2048) * 1.5 + tp_size / 8 * 1024
    if cuda_graphs:
        prefill_max = min(chunk, max_total_tokens) if max_total_tokens else chunk  # server_args.py:4729-4737
        reserved += max_bs * 2 + len(prefill_graph_sizes(prefill_max)) * 8
    if mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mem - reserved) / mem, 3)


@dataclass
class SGLangEngineGPU:
    """One SGLang engine GPU: its items (bytes), the KV pool's figures, what does not fit."""

    items: dict[str, float]
    mem_fraction_static: float
    kv_budget: float  # mem_fraction_static x GPU memory - weights
    kv_bytes_per_token: float  # TRACE's layout on this GPU (NVFP4, or BF16 in a bf16 engine)
    sglang_bytes_per_token: float  # what SGLang divides the budget by (BF16 cells)
    tokens_admitted: int  # SGLang's pool: min(budget / its cells, max_total_tokens)
    tokens_fit: int  # TRACE's layout in the same budget
    tokens_needed: int  # the step's in-flight samples on this engine
    problems: list[str] = field(default_factory=list)  # layouts SGLang would pad or refuse
    shortfalls: list[str] = field(default_factory=list)  # memory that does not suffice (more engine TP helps)

    @property
    def total(self) -> float:
        return sum(self.items.values())

    def summary(self) -> str:
        """One line: the fraction, the budget and the tokens."""
        return (f"SGLang KV pool: mem_fraction_static {self.mem_fraction_static:.3f} -> "
                f"{self.kv_budget / GiB:.1f} GiB after the weights; {self.kv_bytes_per_token:.0f} B per token here "
                f"({self.tokens_fit} tokens would fit), SGLang counts {self.sglang_bytes_per_token:.0f} B "
                f"and admits {self.tokens_admitted}; the step's in-flight samples need {self.tokens_needed}")


def engine_weight_bytes(arch: Architecture, tp: int, fp4: bool) -> float:
    """Bytes of weights on one GPU of an SGLang engine of tp_size `tp` (and any ep_size): FP4 sites
    packed (codes + E4M3 scale per 16) when `fp4`, norms FP32, the rest BF16."""
    head = arch.attn_out_width // arch.q_heads
    attn = arch.attn_params / tp
    if arch.kv_width == 2 * arch.kv_heads * head:  # GQA: each rank keeps max(1, kv / tp) KV heads
        attn += arch.hidden * head * 2 * (max(1, arch.kv_heads // tp) - arch.kv_heads / tp)
    # experts / ep on a GPU, each of width moe_ffn / (tp / ep): 1 / tp of them under any ep dividing tp
    ffn = sum(sum(arch.ffn_params(layer)) for layer in range(arch.layers)) / tp
    fp4_sites = arch.layers * attn + ffn
    vocab = math.ceil(arch.vocab / VOCAB_PADDING) * VOCAB_PADDING
    embeddings = vocab * arch.hidden * (1 if arch.tie_embeddings else 2) / tp
    norms = arch.layers * arch.norm_params + arch.hidden  # FP32 (sglang_rollout/sglang/numerics.py)
    routers = arch.moe_layers * arch.experts * arch.hidden
    rest = 2 * (embeddings + routers) + 4 * norms
    return fp4_sites * (0.5 + 1 / 16 if fp4 else 2) + rest


def layout_problems(arch: Architecture, tp: int, ep: int) -> list[str]:
    """Why SGLang cannot run TRACE's policy with this tp_size / ep_size (sglang_rollout/sglang/
    config.py check_layout: no padded FP4 rows)."""
    out = []
    if tp % ep:
        out.append(f"SGLang engine: rollout.sglang ep_size {ep} does not divide dist.engine_tp={tp}")
        return out
    if arch.experts % ep:
        out.append(f"SGLang engine: ep_size {ep} does not divide the {arch.experts} experts")
    moe_tp = tp // ep
    if moe_tp > 1 and (arch.moe_ffn % moe_tp or (arch.moe_ffn // moe_tp) % MOE_PADDING):
        out.append(f"SGLang engine: experts of width {arch.moe_ffn} over {moe_tp} moe-TP ranks (tp / ep) would be "
                   f"padded to a multiple of {MOE_PADDING}; choose dist.engine_tp / ep_size so that they are not")
    if arch.q_heads % tp:
        out.append(f"SGLang engine: dist.engine_tp={tp} does not divide the {arch.q_heads} attention heads")
    return out


def sglang_engine_gpu(arch: Architecture, *, fp4: bool, tp: int, options: dict, gpu_memory_gib: float,
                      tokens_needed: int, tokens_asked: int, guidance: bool) -> SGLangEngineGPU:
    """One GPU of an SGLang engine of tp_size `tp` with SGLang's options `options` (rollout.sglang):
    its weights, its KV pool as SGLang sizes it, the workspace;
    `tokens_asked`: the max_total_tokens TRACE passes (the step's share, in KV blocks);
    `guidance`: the engine records guidance (TRACE then turns CUDA graphs off)."""
    ep = int(options.get("ep_size", 1))
    weights = engine_weight_bytes(arch, tp, fp4)
    graphs = not (guidance and fp4) and not options.get("disable_cuda_graph", False)
    asked = int(options.get("max_total_tokens") or tokens_asked)
    fraction = options.get("mem_fraction_static") or default_mem_fraction_static(
        gpu_memory_gib, tp, graphs, options.get("chunked_prefill_size"), asked)
    budget = fraction * gpu_memory_gib * GiB - weights
    if arch.kv_bf16_width:  # MLA: one latent row (+ RoPE key) per token and layer, whole on every rank
        # under trace_fp4 SGLang counts TRACE's cells (the plugin's cell-size hook), else its BF16 rows
        cell = sglang_cell = round(arch.layers * arch.kv_bytes_per_token(fp4))
    else:
        head = arch.kv_width // (2 * arch.kv_heads)
        heads = max(1, arch.kv_heads // tp)  # SGLang's get_num_kv_heads (configs/model_config.py:1121-1128)
        sglang_cell = arch.layers * heads * 2 * head * 2  # K and V, BF16
        cell = arch.layers * heads * 2 * (head // 2 + head // 16 + 4) if fp4 else sglang_cell
    admitted = max(0, min(int(budget // sglang_cell), asked))
    ep_text = f" EP{ep}" if ep > 1 else ""
    items = {f"weights ({'FP4 codes + scales' if fp4 else 'BF16'}; SGLang TP{tp}{ep_text})": weights,
             f"KV pool ({'TRACE NVFP4' if fp4 else 'BF16'}, {admitted} tokens)": admitted * cell,
             f"workspace ({'' if graphs else 'no '}CUDA graphs; measured)": workspace_bytes(
                 arch, graphs, int(options.get("chunked_prefill_size") or chunked_prefill(gpu_memory_gib)))}
    gpu = SGLangEngineGPU(items=items, mem_fraction_static=fraction, kv_budget=budget,
                          kv_bytes_per_token=cell, sglang_bytes_per_token=sglang_cell, tokens_admitted=admitted,
                          tokens_fit=max(0, int(budget // cell)), tokens_needed=tokens_needed,
                          problems=layout_problems(arch, tp, ep))
    if budget <= 0:
        gpu.shortfalls.append(f"SGLang engine: mem_fraction_static {fraction:.3f} of {gpu_memory_gib:g} GiB leaves "
                              f"nothing for the KV pool after {weights / GiB:.1f} GiB of weights (SGLang refuses to "
                              "start); raise dist.engine_tp or rollout.sglang mem_fraction_static")
    elif admitted < tokens_needed:
        gpu.shortfalls.append(f"SGLang engine: its KV pool admits {admitted} tokens, the step's in-flight samples "
                              f"need {tokens_needed}; raise dist.engine_tp or rollout.sglang mem_fraction_static")
    return gpu
