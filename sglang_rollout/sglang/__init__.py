"""SGLang as TRACE's rollout engine: the plugin SGLang loads in its processes (`plugin`: the
trace_fp4 quantization method, the NVFP4 KV cache, guidance capture) and `SGLangEngine`, the
RolloutBackend around `sglang.Engine` (backend path "sglang_rollout.sglang:SGLangEngine").
Importing this package imports neither sglang nor torch: SGLang's processes import
`cpu_patches` through it before SGLang itself."""

__all__ = ["EngineConfig", "SGLangEngine"]


def __getattr__(name: str):
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
