"""TRACE's SGLang plugin, loaded by SGLang (entry point group `sglang.srt.plugins`, setup.cfg) in
its engine process and in every scheduler process before a model is built. It registers the
`trace_fp4` quantization method and the `trace_fp4` attention backend (`attention`: it reads
TRACE's NVFP4 KV cache), and hooks SGLang's KV-pool construction so that an engine asked for
`quantization="trace_fp4"` stores its KV cache in TRACE's NVFP4 (`kv_cache`). Engines that
ask for anything else are untouched. In the processes of an engine TRACE started (`SEEDED` set),
a request's `sampling_seed` fixes its draws (SGLang reads it only in its deterministic mode,
which its CPU attention does not support) and the loaded model computes what the trainer
computes (`numerics`); with guidance asked for (capture.ENV), the capturer is hooked around
each forward (and each decode CUDA graph's capture) and each request's end.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

KV_POOL_BUILDER = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool"
MLA_POOL_BUILDER = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mla_kv_pool"
CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
DEEPSEEK_POST_LOAD = ("sglang.srt.models.deepseek_common.deepseek_weight_loader.DeepseekV2WeightLoaderMixin."
                      "post_load_weights")
QUANTIZED_KV_WRITE = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._set_quantized_kv_buffer"
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
DECODE_GRAPH_CAPTURE = ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner."
                        "capture_one_shape")
MODEL_LOADED = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
FUSED_KV_WRITE = "sglang.srt.models.utils.enable_fused_set_kv_buffer"
DISTRIBUTED_UPDATE = ("sglang.srt.model_executor.model_runner_components.weight_updater."
                      "WeightUpdater.update_weights_from_distributed")
REQUEST_FINISHED = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                    "SchedulerBatchResultProcessor._maybe_collect_routed_experts")
SEEDED = "TRACE_SGLANG_SEEDED"
_registered = False


def register() -> None:
    """Register `trace_fp4` and the hooks, once per process (SGLang calls this)."""
    global _registered
    if _registered:
        return
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_quantization_method_choices

    from . import capture
    from .quant import NAME, TraceFP4Config

    QUANTIZATION_METHODS[NAME] = TraceFP4Config
    add_quantization_method_choices([NAME])
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import add_attention_backend_choices

    from . import attention

    ATTENTION_BACKENDS[attention.NAME] = attention.create
    add_attention_backend_choices([attention.NAME])
    HookRegistry.register(KV_POOL_BUILDER, _build_kv_pool, HookType.AROUND)
    HookRegistry.register(MLA_POOL_BUILDER, _build_mla_pool, HookType.AROUND)
    HookRegistry.register(CELL_SIZE, _cell_size, HookType.AROUND)
    HookRegistry.register(QUANTIZED_KV_WRITE, _write_quantized_kv, HookType.AROUND)
    HookRegistry.register(FUSED_KV_WRITE, _fused_kv_write, HookType.AROUND)
    HookRegistry.register(DISTRIBUTED_UPDATE, _update_from_distributed, HookType.AROUND)
    if os.environ.get(SEEDED) == "1":
        _seed_sampling()
        HookRegistry.register(DEEPSEEK_POST_LOAD, _skip_post_load, HookType.AROUND)
        HookRegistry.register(MODEL_LOADED, _align_numerics, HookType.AFTER)
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler.trace_quantization_table = _quantization_table
    Scheduler.trace_memory = _memory
    capture.configure_from_env()
    if capture.active():  # guidance capture: around each forward, at each request's end, and the RPC
        HookRegistry.register(MODEL_FORWARD, _forward, HookType.AROUND)
        HookRegistry.register(DECODE_GRAPH_CAPTURE, _capture_decode_graph, HookType.AROUND)
        HookRegistry.register(REQUEST_FINISHED, _request_finished, HookType.AFTER)
        Scheduler.trace_dump_guidance = _dump_guidance
    _registered = True


def _build_kv_pool(original, configurator, *args, quant_method=None, **kwargs):
    """SGLang's MHA pool, with TRACE's NVFP4 KV method for a trace_fp4 engine."""
    from .quant import NAME

    if getattr(configurator.model_config, "quantization", None) == NAME:
        if quant_method is not None:
            raise ValueError("trace_fp4 brings its own NVFP4 KV cache: leave kv_cache_dtype at its default")
        from .kv_cache import TraceNVFP4KVMethod

        quant_method = TraceNVFP4KVMethod()
        logger.info("trace_fp4: the KV cache is TRACE's NVFP4 (one global scale per token and KV head)")
    return original(configurator, *args, quant_method=quant_method, **kwargs)


def _build_mla_pool(original, configurator, *, max_total_num_tokens: int):
    """SGLang's MLA pool, or TRACE's FP4 latent pool (mla.TraceNVFP4MLAPool) for a trace_fp4 engine."""
    from .quant import NAME

    if getattr(configurator.model_config, "quantization", None) != NAME:
        return original(configurator, max_total_num_tokens=max_total_num_tokens)
    import torch
    from sglang.srt.runtime_context import get_exec

    from .mla import TraceNVFP4MLAPool

    if configurator.kv_cache_dtype != torch.bfloat16:
        raise ValueError("trace_fp4 brings its own NVFP4 MLA latent cache: leave kv_cache_dtype at its default")
    logger.info("trace_fp4: the MLA latent cache is TRACE's NVFP4 (one global scale per token), the RoPE key BF16")
    return TraceNVFP4MLAPool(max_total_num_tokens, page_size=configurator.pool_page_size,
                             dtype=configurator.kv_cache_dtype, kv_lora_rank=configurator.model_config.kv_lora_rank,
                             qk_rope_head_dim=configurator.model_config.qk_rope_head_dim,
                             layer_num=configurator.layer_info.num_effective_layers, device=configurator.device,
                             enable_memory_saver=get_exec().features.enable_memory_saver,
                             start_layer=configurator.layer_info.start_layer,
                             end_layer=configurator.layer_info.end_layer)


def _cell_size(original, pool_configurator, kvc, num_layers: int) -> int:
    """KV bytes per token, for SGLang's token budget: TRACE's FP4 latent cells under trace_fp4 MLA
    (SGLang would count BF16 rows and admit ~2.7x too few tokens)."""
    from .quant import NAME

    if kvc.use_mla_backend and getattr(kvc.model_config, "quantization", None) == NAME:
        from .mla import TraceNVFP4MLAPool

        return num_layers * TraceNVFP4MLAPool.cell_bytes(kvc.model_config.kv_lora_rank,
                                                         kvc.model_config.qk_rope_head_dim)
    return original(pool_configurator, kvc, num_layers)


def _skip_post_load(original, model, *args, **kwargs):
    """No DeepSeek post-load in an engine TRACE started: it slices kv_b's BF16 weight into the
    absorbed attention's w_kc / w_vc (which TRACE's MLA forward never reads, and which trace_fp4's
    packed kv_b no longer has), and fuses shared experts (TRACE starts engines without)."""
    return None


def _fused_kv_write(original, *args, **kwargs) -> bool:
    """No K/V write fused into the rotary kernel into TRACE's NVFP4 pool (SGLang checks only the
    pool's compute dtype, and a fused write would store BF16 rows), nor in an engine TRACE
    started (sgl_kernel's fallback rotary for small head dims refuses a fused write)."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    from .kv_cache import TraceNVFP4KVMethod

    if os.environ.get(SEEDED) == "1" or isinstance(getattr(get_token_to_kv_pool(), "quant_method", None),
                                                   TraceNVFP4KVMethod):
        return False
    return original(*args, **kwargs)


def _update_from_distributed(original, updater, names, dtypes, shapes, group_name, load_format=None):
    """update_weights_from_distributed with a custom weight loader (SGLang's own path calls only
    the model's loader): each of `names` is one of TRACE's flat uint8 weight buckets
    (weight_payload), one broadcast from the trainer each, handed to the loader named by
    load_format (TRACE's writes FP4 in place). Other load formats take SGLang's path."""
    if load_format not in updater.custom_weight_loaders:
        return original(updater, names, dtypes, shapes, group_name, load_format)
    import torch
    from sglang.srt.utils import dynamic_import

    from .weight_group import broadcast_bucket

    try:
        named = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if str(dtype).removeprefix("torch.") != "uint8" or len(shape) != 1:
                raise ValueError(f"{name}: a weight bucket is a flat uint8 tensor, got {dtype} {shape}")
            named.append((name, torch.empty(shape, dtype=torch.uint8, device=updater.device)))
            broadcast_bucket(named[-1][1], updater._model_update_group[group_name])
        dynamic_import(load_format)(updater.get_model(), named)
    except Exception as e:  # noqa: BLE001 - SGLang's convention: (success, message) back to the caller
        logger.exception("trace: weight update from the trainer's group failed")
        return False, f"trace: weight update failed ({type(e).__name__}: {e}); the weights may be partly updated"
    return True, f"trace: {len(names)} tensors loaded from group {group_name}"


def _write_quantized_kv(original, pool, layer_id, global_layer_id, *args, **kwargs):
    """Tell the guidance capturer which layer a quantized K/V write belongs to."""
    from . import capture

    with capture.at_layer(global_layer_id):
        return original(pool, layer_id, global_layer_id, *args, **kwargs)


def _forward(original, runner, forward_batch, *args, **kwargs):
    """A model forward, with the capturer told the KV slots of its tokens."""
    from . import capture

    pool = runner.token_to_kv_pool
    with capture.forward(forward_batch.out_cache_loc, pool.size + pool.page_size):
        out = original(runner, forward_batch, *args, **kwargs)
        if getattr(out, "can_run_graph", False):
            if not forward_batch.forward_mode.is_decode():
                raise RuntimeError("guidance capture: a prefill CUDA graph ran (its rows are not captured); "
                                   "TRACE's engine turns SGLang's prefill graphs off when guidance is on")
            capture.file_staged()
        return out


def _capture_decode_graph(original, graph_runner, size: int, *args, **kwargs):
    """SGLang's capture of one decode CUDA graph (`size` requests), with the capturer told to
    stage the graph's rows on the device."""
    from . import capture

    if graph_runner.ragged_verify_mode:
        raise RuntimeError("guidance capture: speculative decoding's ragged verify graphs are not supported")
    width = graph_runner.captured_req_width
    with capture.graph_capture(size * width, max(graph_runner.capture_bs) * width):
        return original(graph_runner, size, *args, **kwargs)


def _request_finished(result, processor, req, *args, **kwargs):
    """Gather a finished request's guidance rows by its KV slots (before SGLang frees them)."""
    from . import capture

    seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
    capture.collect(req.rid, processor.req_to_token_pool.req_to_token[req.req_pool_idx][: seqlen - 1])
    return result


def _dump_guidance(scheduler, rids: list[str], path: str) -> None:
    """SGLang RPC (Engine.collective_rpc("trace_dump_guidance", ...)): write the rows of `rids`."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank

    from . import capture

    capture.dump(rids, path, get_tensor_model_parallel_rank())


def _align_numerics(result, runner, *args, **kwargs):
    """The trainer's arithmetic in the model just loaded (numerics.align_model)."""
    from .numerics import align_model

    align_model(runner)
    return result


def _seed_sampling() -> None:
    """Make each request's sampling_seed reach SGLang's sampler: its draws are then a function of
    the seed and the token's position (a Gumbel trick), so a sample's tokens do not depend on
    the batch it runs in."""
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls, batch, vocab_size: int):
        info = original(cls, batch, vocab_size)
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if info.sampling_seed is None and any(s is not None for s in seeds):
            if any(s is None for s in seeds):
                raise ValueError("trace: every request of a seeded TRACE engine carries a sampling_seed")
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=batch.device)
        return info
    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)


def _quantization_table(scheduler, path: str) -> None:
    """SGLang RPC: write {HF module: "fp4" | "bf16"} of this rank's model as SGLang built it (every
    linear the audit knows, the experts' gate/up/down, each layer's KV cache; "missing" for one
    SGLang did not build) to path/rank<r>.json."""
    import json

    from sglang.srt.distributed import get_tensor_model_parallel_rank

    from megatron_trace.checkpoint.audit import table_from_weights

    from .kv_cache import TraceNVFP4KVMethod
    from .mla import TraceNVFP4MLAPool
    from .weights import model_config_of

    runner = scheduler.tp_worker.model_runner
    built = {}
    for name, module in runner.model.named_modules():
        method = type(getattr(module, "quant_method", None)).__name__
        packed = hasattr(module, "trace_weight") or hasattr(module, "trace_w13")
        precision = "fp4" if packed and method.startswith("TraceFP4") else "bf16"
        leaf = name.rpartition(".")[2]
        if leaf == "experts" and hasattr(module, "num_experts"):
            w2 = "fp4" if hasattr(module, "trace_w2") and precision == "fp4" else "bf16"
            for e in range(module.num_experts):
                built |= {f"{name}.{e}.gate_proj": precision, f"{name}.{e}.up_proj": precision,
                          f"{name}.{e}.down_proj": w2}
        else:
            built |= {name.removesuffix(leaf) + hf: precision for hf in _FUSED.get(leaf, (leaf,))}
    pool = runner.token_to_kv_pool
    kv_fp4 = isinstance(pool, TraceNVFP4MLAPool) or isinstance(getattr(pool, "quant_method", None),
                                                                  TraceNVFP4KVMethod)
    every = table_from_weights(model_config_of(runner.model), lambda name: False, kv_fp4)
    table = {m: every[m] if m.endswith(".kv_cache") else built.get(m, "missing") for m in every}
    with open(f"{path}/rank{get_tensor_model_parallel_rank()}.json", "w") as f:
        json.dump(table, f)


def _memory(scheduler, path: str) -> None:
    """SGLang RPC: write this scheduler process's memory, {"device", "peak", "now"} in bytes, to
    path/rank<r>.json: on a GPU what torch's allocator has held at most since the process began and
    holds now; on the CPU the process's peak and current resident set (the OS's figures)."""
    import json

    import psutil
    import torch
    from sglang.srt.distributed import get_tensor_model_parallel_rank

    device = scheduler.tp_worker.model_runner.device
    if device == "cuda":
        figures = {"peak": torch.cuda.max_memory_allocated(), "now": torch.cuda.memory_allocated()}
    else:
        figures = {"peak": _peak_rss(), "now": psutil.Process().memory_info().rss}
    with open(f"{path}/rank{get_tensor_model_parallel_rank()}.json", "w") as f:
        json.dump({"device": device} | figures, f)


def _peak_rss() -> int:
    """This process's peak resident set in bytes (Linux reports getrusage's ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# SGLang's fused linears -> the HF modules they hold
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa")}
