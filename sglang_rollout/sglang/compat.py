"""transformers newer than SGLang 0.5.17's pin (5.12.1), on any machine: SGLang registers the
model type `qwen3_asr` at import, which transformers 5.17 and 5.24 already define, and
AutoConfig.register refuses a known name ("'qwen3_asr' is already used by a Transformers
config"). `install()` makes that registration idempotent; it changes nothing else."""

from __future__ import annotations

import importlib.util
import sys


def install() -> None:
    """Patch AutoConfig.register once transformers' configuration_auto is imported (lazily)."""
    if _IdempotentAutoConfig not in sys.meta_path:
        sys.meta_path.insert(0, _IdempotentAutoConfig)


class _IdempotentAutoConfig:
    """A one-shot import hook: after transformers' configuration_auto loads, its
    AutoConfig.register accepts a model type that is already registered."""

    MODULE = "transformers.models.auto.configuration_auto"

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != cls.MODULE:
            return None
        sys.meta_path.remove(cls)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register = module.AutoConfig.register
            module.AutoConfig.register = staticmethod(lambda model_type, config, exist_ok=False:
                                                      register(model_type, config, exist_ok=True))
        spec.loader.exec_module = exec_module
        return spec
