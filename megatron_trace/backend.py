"""Rollout backends by dotted path (`module:Class`, the module also exporting its EngineConfig),
so that megatron_trace never imports the rollout side (kernels <- megatron_trace <- sglang_rollout).
"""

from __future__ import annotations

import importlib

import torch

# rollout.backend's names (config.RolloutSection); any other backend goes by its dotted path
BACKENDS = {"builtin": "sglang_rollout.engine:TraceEngine", "sglang": "sglang_rollout.sglang:SGLangEngine"}
DEFAULT_ENGINE = BACKENDS["builtin"]


def backend_path(backend: str) -> str:
    """The dotted path `module:Class` of a backend name (`builtin`, `sglang`) or path."""
    return BACKENDS.get(backend, backend)


def backend_options(cfg, gpus: list[int] | None = None) -> dict:
    """The EngineConfig fields a run's config (a TrainConfig) sets beyond precision, guidance and
    the KV cache's size: for SGLang its tensor parallelism (`dist.engine_tp`) and its own
    ServerArgs (`rollout.sglang`); `gpus`: the engine's GPUs on a GPU machine (an engine rank's,
    rl.job_layout.rank_gpus), the first of which becomes SGLang's base_gpu_id. Colocated (no
    engine ranks), the engine gives its memory to the trainer while it trains (release_memory)."""
    if cfg.rollout.backend == "sglang":
        sglang = dict(cfg.rollout.sglang)
        if gpus:
            sglang["base_gpu_id"] = gpus[0]
        return {"tp_size": cfg.dist.engine_tp, "sglang": sglang, "release_memory": cfg.dist.engine_ranks == 0}
    return {}


def load_backend(path: str):
    """The backend class at dotted path `module:Class` (or a name of BACKENDS); SystemExit naming
    it when it cannot be imported."""
    path = backend_path(path)
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--engine {path!r}: cannot import it ({e})") from None


def make_backend(path: str, model_cfg, **engine_options):
    """An engine of the backend class at `path` for `model_cfg` (a ModelConfig), configured by
    its module's EngineConfig(**engine_options)."""
    engine_cls = load_backend(path)
    return engine_cls(model_cfg, engine_config(path, **engine_options))


def engine_config(path: str, **engine_options):
    """The EngineConfig of the backend at `path` (or of a name of BACKENDS) with these fields:
    ValueError (from the config's own checks) for a field or value it refuses."""
    return importlib.import_module(backend_path(path).partition(":")[0]).EngineConfig(**engine_options)


def engine_factory(path: str, model_cfg, model_id: str, num_blocks: int = 4096, probe: tuple | None = None,
                   **options):
    """make_engine(precision, guide, coding) for the backend class at `path` (or a name of
    BACKENDS), with a KV cache of `num_blocks` blocks and the backend's further EngineConfig
    fields `options` (backend_options). The backend and its options, with `probe` = (precision,
    guide, coding) when given (the run's), are checked now, not at the first rollout."""
    load_backend(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = dict(zip(("precision", "guide", "coding"), probe or (), strict=False))
    engine_config(path, device=device, model_id=model_id, num_blocks=num_blocks, **settings, **options)

    def make_engine(precision, guide, coding):
        return make_backend(path, model_cfg, precision=precision, guide=guide, coding=coding, device=device,
                            model_id=model_id, num_blocks=num_blocks, **options)
    return make_engine
