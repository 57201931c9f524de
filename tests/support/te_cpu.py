"""Transformer Engine's Python classes on the CPU, for tests only: no GPU path imports this.

TE (pinned: 2.20.2, the `transformer-engine` extra of setup.cfg, installed --no-deps into
`.venv/te-python`, off sys.path: see `te()`) ships its
Python in the `transformer_engine` wheel and its kernels in `transformer_engine_cu13` (core) and
`transformer_engine_torch` (the extension, built against torch and CUDA). `import
transformer_engine.pytorch` fails on a CPU machine. The classes TRACE's CPU tests compare against
are pure Python and torch: `QuantizerRole` (the 2.16+ role a `CustomRecipe` factory receives),
`IdentityQuantizer` / `IdentityTensorStorage` (the high-precision storage TRACE's quantizers hold),
`NVFP4QuantizerRef` (TE's reference NVFP4 quantizer), `NVFP4TensorStorage` (the native storage
cuBLAS reads on Blackwell) and the reference's E2M1 pack / unpack. `te()` imports them with
these shims (measured 2026-12-04 on 2.20.2):

- NVTE_PROJECT_BUILDING=1: `transformer_engine.common` otherwise refuses a meta wheel without
  its core wheel and loads cuDNN, NVRTC and cuRAND shared objects.
- `load_framework_extension` -> no-op, and `transformer_engine_torch` a stand-in module whose
  attributes are placeholders (enum members get distinct integers). Its `DType` mirrors the
  Python `DType` members, which `constants.py` asserts at import. Nothing here calls into it:
  a test that reached a C++ kernel would fail on a placeholder.
- `NVTE_Fused_Attn_Backend` of the stand-in: an enum mirroring the Python `FusedAttnBackend`
  members, which `cpp_extensions/fused_attn.py` asserts at import.
- `transformer_engine.pytorch.export` -> `is_in_onnx_export_mode() = False`, `assert_warmed_up`
  a no-op, `onnx_export` None (the real module imports onnxscript).

With these, all of `transformer_engine.pytorch` imports, and so does Megatron's TE extension
(`megatron.core.extensions.transformer_engine`) and TRACE's TE layer spec (`megatron_trace.te.spec`):
the spec's structure is tested on the CPU. TE's modules themselves refuse to be built without
CUDA ("TransformerEngine needs CUDA."), so nothing runs in them here.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import importlib
import itertools
import os
import sys
import types
import warnings

TE_VERSION = "2.20.2"
# Modules that see TE when imported inside `te_importable()`: gone from sys.modules afterwards, so
# that code imported later finds no TE (megatron-core decides HAVE_TE once, at import).
_LEAVES_WITH_TE = ("transformer_engine", "megatron.", "megatron_trace.")
_REIMPORTED_WITH_TE = ("megatron.core.extensions.transformer_engine",)


class _Placeholders(type):
    """A stand-in class: any attribute is a new distinct integer (enum members used at import)."""

    _ids = itertools.count(1 << 20)

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = next(cls._ids)
        setattr(cls, name, value)
        return value


class _ExtensionStandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholders(name, (), {})
        setattr(self, name, value)
        return value


def te_python_dir() -> str:
    """Where the Makefile puts TE's Python (`$(VENV)/te-python`), or $TRACE_TE_PYTHON."""
    return os.environ.get("TRACE_TE_PYTHON") or os.path.join(sys.prefix, "te-python")


@contextlib.contextmanager
def te_importable():
    """Within this block TE's Python imports (with the shims above) from `te_python_dir()`;
    afterwards nothing of it stays visible (sys.path, sys.modules, the environment), while the
    classes and modules imported inside keep working. megatron-core probes `import
    transformer_engine` and must keep finding no TE on the CPU. ImportError when TE is not
    there or is another version."""
    from importlib import metadata

    root = te_python_dir()
    dists = [d for d in metadata.distributions(path=[root]) if d.metadata["Name"] == "transformer_engine"]
    if not dists:
        raise ImportError(f"no transformer_engine in {root}: `make .venv/.te` puts it there")
    if dists[0].version != TE_VERSION:
        raise ImportError(f"transformer_engine {dists[0].version} in {root}, "
                          f"the tests are written against {TE_VERSION}")
    # TRACE's Megatron modules (and the megatron-core they use) imported without TE first: only
    # what needs TE is imported inside, and removed again below
    importlib.import_module("megatron_trace.megatron.model")
    saved_path, saved_env = list(sys.path), os.environ.get("NVTE_PROJECT_BUILDING")
    # megatron-core's TE extension, imported without TE, holds stand-ins: imported again inside
    saved_modules = {n: sys.modules.pop(n) for n in list(sys.modules) if n.startswith(_REIMPORTED_WITH_TE)}
    before = set(sys.modules)
    sys.path.insert(0, root)
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    try:
        _shim(root)
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("NVTE_PROJECT_BUILDING", None)
        else:
            os.environ["NVTE_PROJECT_BUILDING"] = saved_env
        for name in set(sys.modules) - before:
            if name.startswith(_LEAVES_WITH_TE):
                _unbind(name, sys.modules.pop(name))
        for name, module in saved_modules.items():
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:  # `import a.b as m` reads the attribute of the package a
                setattr(sys.modules[parent], child, module)


def _unbind(name: str, module: types.ModuleType) -> None:
    """Drop the attribute through which a removed module was still reachable from its package."""
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
        delattr(sys.modules[parent], child)


@functools.cache
def te() -> types.SimpleNamespace:
    """TE's pure-Python classes the tests use (imported in `te_importable()`)."""
    with te_importable():
        return _import()


def _shim(root: str) -> None:
    tex = _ExtensionStandIn("transformer_engine_torch")
    with open(os.path.join(root, "transformer_engine", "pytorch", "constants.py")) as f:
        source = f.read()
    dtype = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DType")
    tex.DType = enum.IntEnum("DType", [t.targets[0].id for t in dtype.body if isinstance(t, ast.Assign)])
    sys.modules["transformer_engine_torch"] = tex
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "could not find the ... PyTorch extension library"
        import transformer_engine.common as common

    common.load_framework_extension = lambda *args, **kwargs: None
    with open(os.path.join(root, "transformer_engine", "pytorch", "cpp_extensions", "fused_attn.py")) as f:
        source = f.read()
    backend = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "FusedAttnBackend")
    tex.NVTE_Fused_Attn_Backend = enum.IntEnum(
        "NVTE_Fused_Attn_Backend", ["NVTE_" + t.targets[0].id for t in backend.body if isinstance(t, ast.Assign)])
    export = types.ModuleType("transformer_engine.pytorch.export")
    export.is_in_onnx_export_mode = lambda: False
    export.assert_warmed_up = lambda *args, **kwargs: None
    export.onnx_export = None
    sys.modules[export.__name__] = export


def _import() -> types.SimpleNamespace:
    from importlib import metadata

    pytorch = importlib.import_module("transformer_engine.pytorch")

    quantization = importlib.import_module("transformer_engine.pytorch.quantization")
    reference = importlib.import_module("transformer_engine.pytorch.custom_recipes.reference_nvfp4")
    utils = importlib.import_module("transformer_engine.pytorch.custom_recipes.reference_utils")
    storage = importlib.import_module("transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage")
    nvfp4 = importlib.import_module("transformer_engine.pytorch.tensor.nvfp4_tensor")
    identity = importlib.import_module("transformer_engine.pytorch.tensor.identity_tensor")
    constants = importlib.import_module("transformer_engine.pytorch.constants")
    version = metadata.version("transformer_engine")
    # TRACE's recipe subclasses TE's classes: imported in the same block, so its bases are these
    recipe = importlib.import_module("megatron_trace.te.recipe")
    spec = importlib.import_module("megatron_trace.te.spec")
    return types.SimpleNamespace(recipe=recipe, spec=spec, pytorch=pytorch,
        version=version, QuantizerRole=quantization.QuantizerRole, NVFP4QuantizerRef=reference.NVFP4QuantizerRef,
        Fp4Formats=utils.Fp4Formats, cast_to_fp4x2=reference.cast_to_fp4x2, cast_from_fp4x2=reference.cast_from_fp4x2,
        recover_swizzled_scales=reference.NVFP4QuantizerRef._recover_swizzled_scales,
        NVFP4TensorStorage=storage.NVFP4TensorStorage, NVFP4Quantizer=nvfp4.NVFP4Quantizer,
        DType=constants.DType, IdentityQuantizer=identity.IdentityQuantizer,
        IdentityTensorStorage=identity.IdentityTensorStorage)
