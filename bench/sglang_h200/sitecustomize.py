"""Import-time stubs for running SGLang 0.5.17 from a wheel bundle on a machine without internet.
No SGLang file is modified. A stub is installed ONLY when the real package cannot be found on sys.path.
Each stub module returns, for any attribute, a placeholder class: importing/subclassing works, CALLING it
raises RuntimeError("stub called: ..."), so a stub can never silently compute anything.
Accesses are logged to $SGL_STUB_LOG (if set).

Why each stub (see report):
  flashinfer : sglang/srt/layers/sampler.py:31 and layers/quantization/fp8_utils.py:186 do
               `from flashinfer... import ...` unconditionally under `if is_cuda()`. With
               sampling_backend="pytorch", attention_backend="triton" and the triton MoE runner no flashinfer
               function is called. SGLANG_IS_FLASHINFER_AVAILABLE=false is set so that
               sglang.srt.utils.is_flashinfer_available() stays False even though find_spec() sees the stub.
  xgrammar   : sglang/srt/function_call/{inkling,kimik3}_detector.py, kimik3_structural_tag.py import
               StructuralTag & *Format at module level (real wheel is 44 MB). Its attributes are stubbed as
               empty pydantic models (they are used as pydantic field types in entrypoints/openai/protocol.py).
               No grammar backend is created with skip_tokenizer_init=True (constrained/grammar_manager.py:31).
  IPython    : sglang/utils.py:26 `from IPython.display import HTML, display` (notebook helpers only).
"""
import importlib.machinery
import os
import sys
import types

_STUBS = [s for s in os.environ.get("SGL_STUBS", "flashinfer,IPython,xgrammar").split(",") if s]
_LOG = os.environ.get("SGL_STUB_LOG")


def _log(msg):
    if _LOG:
        try:
            with open(_LOG, "a") as f:
                f.write(f"{msg} pid={os.getpid()}\n")
        except Exception:  # noqa: BLE001 - the stub log is best-effort
            pass


class _StubMeta(type):
    def __call__(cls, *a, **k):
        _log(f"CALL {cls._stub_name}")
        raise RuntimeError(f"stub called: {cls._stub_name} (package not bundled)")

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _make_attr(f"{cls._stub_name}.{attr}")


_PYDANTIC_TOPS = {"xgrammar"}  # their classes are used as pydantic field types / base classes


def _make_attr(full):
    if full.split(".")[0] in _PYDANTIC_TOPS:
        import pydantic
        return type(full.rsplit(".", 1)[-1], (pydantic.BaseModel,),
                    {"model_config": pydantic.ConfigDict(extra="allow"), "__module__": full.rsplit(".", 1)[0]})
    return _StubMeta(full.rsplit(".", 1)[-1], (), {"_stub_name": full})


class _StubModule(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__file__ = f"<stub {name}>"
        self.__spec__ = importlib.machinery.ModuleSpec(name, _Finder, is_package=True)
        self.__version__ = "0.0.0+stub"

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        _log(f"attr {full}")
        v = _make_attr(full)
        setattr(self, attr, v)
        return v


class _Finder:
    active = set()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top not in cls.active:
            return None
        _log(f"import {fullname}")
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @staticmethod
    def create_module(spec):
        return _StubModule(spec.name)

    @staticmethod
    def exec_module(module):
        name = module.__name__
        if "." in name:
            parent, child = name.rsplit(".", 1)
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)


for _n in _STUBS:
    if importlib.machinery.PathFinder.find_spec(_n) is None:
        _Finder.active.add(_n)
if _Finder.active:
    sys.meta_path.append(_Finder)  # appended: a real package found by the normal finders always wins
if "flashinfer" in _Finder.active:
    os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")

# transformers 5.17 (on the GPU machine) already defines model_type "qwen3_asr", which sglang 0.5.17
# (pinned to transformers 5.12.1) registers at import: the project's compat shim
if os.environ.get("SGL_TF_COMPAT", "1") == "1":
    from sglang_rollout.sglang import compat

    compat.install()
