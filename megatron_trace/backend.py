"""Rollout backends by dotted path (`module:Class`, the module also exporting its EngineConfig),
so that megatron_trace never imports the rollout side (kernels <- megatron_trace <- sglang_rollout).
"""

from __future__ import annotations

import importlib

import torch

DEFAULT_ENGINE = "sglang_rollout.engine:TraceEngine"


def load_backend(path: str):
    """The backend class at dotted path `module:Class`; SystemExit naming it when it cannot be imported."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--engine {path!r}: cannot import it ({e})") from None


def make_backend(path: str, model_cfg, **engine_options):
    """An engine of the backend class at `path` for `model_cfg` (a ModelConfig), configured by
    its module's EngineConfig(**engine_options)."""
    engine_cls = load_backend(path)
    config_cls = importlib.import_module(path.partition(":")[0]).EngineConfig
    return engine_cls(model_cfg, config_cls(**engine_options))


def engine_factory(path: str, model_cfg, model_id: str, num_blocks: int = 4096):
    """make_engine(precision, guide, coding) for the backend class at `path`, with a KV cache of
    `num_blocks` blocks."""
    load_backend(path)  # fail now, not at the first rollout
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def make_engine(precision, guide, coding):
        return make_backend(path, model_cfg, precision=precision, guide=guide, coding=coding, device=device,
                            model_id=model_id, num_blocks=num_blocks)
    return make_engine
