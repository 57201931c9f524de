"""The built-in rollout engine: Qwen3-MoE-style models with FP4 weights, activations and KV cache."""

from .config import EngineConfig
from .engine import TraceEngine

__all__ = ["EngineConfig", "TraceEngine"]
