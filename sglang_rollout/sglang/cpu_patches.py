"""What SGLang 0.5.17 needs to run on a CPU-only machine beside torch 2.13.0 (CI, tests, the CPU
launch path). Nothing here runs where CUDA is present: `install()` returns at once there.

Applied in every process SGLang starts (its scheduler and detokenizer are spawned, and they import
SGLang before any plugin runs) through `cpu_site/sitecustomize.py`, which `SGLangEngine` puts on
PYTHONPATH for a CPU engine; the calling process applies them by calling `install()` before
importing sglang. No file of SGLang is edited. Each shim names the error that forced it
(docs/notes/sglang-integration.md has the measurements):

1. torchvision. SGLang imports it unconditionally (`srt/utils/common.py`, its multimodal
   configs), and the registry's torchvision is a CUDA build that cannot load beside CPU torch
   ("operator torchvision::nms does not exist"); installed, it would also break transformers'
   model imports in the same environment. So it is not installed: a stub package stands in,
   whose every attribute is a stub that raises when called (text models never call it).
2. transformers newer than SGLang's pin (`compat`: also needed on the GPU machine).
3. `sgl_kernel` (no CPU build): the same kind of stub, so imports that are never used on the
   CPU path succeed and a call is an error, never a silent no-op.
4. `pin_memory=True` dropped from `torch.zeros` (the routed-experts host buffer asks for it; CPU
   torch has no pinned allocator: "pin_memory=True requires a CUDA or other accelerator backend").
5. SGLang picks its Triton metadata kernels (req_to_token writes) by the attention backend's
   name (`support_triton`: every backend but torch_native and intel_amx); on the CPU they run in
   Triton's interpreter and fail ("only 0-dimensional arrays can be converted to Python
   scalars"), so TRACE's `trace_fp4` backend takes SGLang's torch path there, as torch_native does.
6. Pages of more than one token (`page_size` > 1): SGLang's paged allocator places each forward's
   new tokens with two Triton kernels, which fail in the interpreter the same way. The extend one
   is served by SGLang's own torch version of it (`alloc_extend_naive`), the decode one by a torch
   version of its rule (a token that opens a page takes the next free page, the others follow the
   previous token's slot).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

from . import compat

_installed = False
STUBBED = ("sgl_kernel", "torchvision")  # packages served by a stub when no real one is installed


def install() -> bool:
    """Apply the shims in this process, once; False (nothing done) where CUDA is present."""
    global _installed
    import torch

    if _installed or torch.cuda.is_available():
        return _installed
    compat.install()
    sys.meta_path.append(_StubFinder)
    _drop_pin_memory(torch)
    _torch_metadata_for("trace_fp4")
    _paged_allocation_in_torch()
    _installed = True
    return True


class _Stub:
    """What a stubbed package's names resolve to: attribute chains resolve (module-level code
    reads `InterpolationMode.BICUBIC`), calling or subclassing it raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} was called, but this CPU machine has only a stub of it "
                           "(sglang_rollout.sglang.cpu_patches)")

    def __mro_entries__(self, bases):
        raise RuntimeError(f"{self._name}: cannot subclass a stub (sglang_rollout.sglang.cpu_patches)")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _StubFinder:
    """Serves stub modules for the STUBBED packages and their submodules when no real one is
    installed (a real package always wins)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        root = fullname.partition(".")[0]
        if root not in STUBBED or importlib.machinery.PathFinder.find_spec(root) is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @staticmethod
    def create_module(spec):
        module = _StubModule(spec.name)
        module.__file__ = "<stub: sglang_rollout.sglang.cpu_patches>"
        module.__version__ = "0.0.0+stub"  # transformers parses it; below any version it uses features of
        module.__path__ = []
        return module

    @staticmethod
    def exec_module(module):
        pass


def _drop_pin_memory(torch) -> None:
    zeros = torch.zeros

    def zeros_unpinned(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return zeros(*args, **kwargs)
    torch.zeros = zeros_unpinned


def _torch_metadata_for(backend_name: str) -> None:
    from sglang.srt import utils
    from sglang.srt.utils import common

    original = common.support_triton

    def support_triton(backend: str) -> bool:
        return backend != backend_name and original(backend)
    common.support_triton = utils.support_triton = support_triton


class _Launch:
    """`kernel[grid](*args)`, as SGLang launches its allocator kernels, calling a torch function."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _paged_allocation_in_torch() -> None:
    from sglang.srt.mem_cache.allocator import paged

    def pages_opened(before, after, page_size):
        return (after + page_size - 1) // page_size - (before + page_size - 1) // page_size

    def extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _bs_upper, page_size):
        if int(pages_opened(prefix_lens, seq_lens, page_size).sum()) > free_pages.numel():
            return  # the allocator sees too few free pages and returns None
        paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size,
                                 out_indices.device)

    def decode(seq_lens, last_loc, free_pages, out_indices, _bs_upper, page_size):
        opens = pages_opened(seq_lens - 1, seq_lens, page_size).bool()  # this token starts a page
        if int(opens.sum()) > free_pages.numel():
            return
        out_indices.copy_(last_loc + 1)
        out_indices[opens] = free_pages[: int(opens.sum())].to(out_indices.dtype) * page_size

    paged.alloc_extend_kernel, paged.alloc_decode_kernel = _Launch(extend), _Launch(decode)
