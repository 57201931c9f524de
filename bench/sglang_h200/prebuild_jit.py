"""Build SGLang's JIT-compiled Marlin kernels for an H200 (sm_90a) ahead of time, on any machine with nvcc.

SGLang 0.5.17 compiles its Marlin GEMMs (the weight-only NVFP4 path ModelOpt checkpoints take on Hopper)
with nvcc at their first forward, through tvm-ffi; on the GPU machine that took longer than a 230 s
engine budget twice. The modules are content-addressed (kernel sources, arch, tvm-ffi version) and hold
no torch symbols, so a cache built here loads there:

    TVM_FFI_CACHE_DIR=.sgljit .venv/bin/python bench/sglang_h200/prebuild_jit.py   # here (nvcc 13)
    carry .sgljit; on the GPU machine: TVM_FFI_CACHE_DIR=$PWD/.sgljit bash .sgl/run.sh ...

Pretends a sm_90 device for SGLang's arch detection (this machine has none); loading the built module
here may fail for want of a GPU driver: the .so stays in the cache.
"""

import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_rollout.sglang import cpu_patches  # noqa: E402 - SGLang imports torchvision/sgl_kernel at once

cpu_patches.install()
# the link step wants libcudart.so; a CUDA toolkit without a driver keeps it in the toolkit, not in /usr/local/lib64
_roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", str(Path(shutil.which("nvcc") or "/").resolve().parents[1])]
_libs = [str(Path(r, sub)) for r in filter(None, _roots) for sub in ("lib", "lib64", "targets/x86_64-linux/lib")
         if Path(r, sub, "libcudart.so").exists()]
os.environ["LIBRARY_PATH"] = os.pathsep.join([*_libs, *filter(None, [os.environ.get("LIBRARY_PATH")])])
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: (9, 0)

from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module  # noqa: E402
from sglang.kernels.ops.quantization.gptq_marlin import _jit_gptq_marlin_module  # noqa: E402
from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module  # noqa: E402

BUILDS = {
    "gptq_marlin": lambda: _jit_gptq_marlin_module(torch.bfloat16),
    "moe_wna16_marlin": lambda: _jit_moe_wna16_marlin_module(torch.bfloat16, False, False),
    "gptq_marlin_repack": _jit_gptq_marlin_repack_module,
}

for name in sys.argv[1:] or BUILDS:
    try:
        BUILDS[name]()
        print(f"{name}: built and loaded")
    except Exception as e:  # noqa: BLE001 - a load failure without a GPU is expected; the build is what counts
        print(f"{name}: {type(e).__name__}: {str(e)[-600:]}")

# only the built modules travel: the object files double the carry
for path in Path(os.environ.get("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi")).expanduser().glob("*/*"):
    if path.suffix != ".so":
        path.unlink()
