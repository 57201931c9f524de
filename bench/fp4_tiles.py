"""Sweep the FP4 kernels' tile size on the GPU (8192x8192 bf16) and report registers and spills.

    python bench/fp4_tiles.py
"""

import torch
import triton.testing

from trace_kernels.fp4 import dequantize, quantize, triton_fp4

x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
n = x.numel()
src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
bw = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3)
print(f"copy {bw / 1e12:.3f} TB/s")
for tile in (1024, 2048, 4096, 8192, 16384):
    triton_fp4.TILE_ELEMENTS = tile
    for fmt, scale in (("nvfp4", "tensor"), ("nvfp4", "row"), ("mxfp4", None)):
        amax = x.abs().amax().float() if scale == "tensor" else None
        kw = {"global_amax": amax} if amax is not None else {}
        t = triton.testing.do_bench(lambda: quantize(x, fmt, scale, **kw), return_mode="median") / 1e3
        q = quantize(x, fmt, scale, **kw)
        td = triton.testing.do_bench(lambda: dequantize(q, torch.bfloat16), return_mode="median") / 1e3
        qb = n // 2 + n // q.block_size
        print(f"tile {tile:6d} {fmt}/{scale}: quantize {t * 1e6:7.1f} us {(2 * n + qb) / t / bw:.3f} of copy | "
              f"dequantize {td * 1e6:7.1f} us {(2 * n + qb) / td / bw:.3f}")
try:  # compiled-kernel introspection is Triton-version specific: report what is there
    for kern in (triton_fp4._quantize_kernel, triton_fp4._dequantize_kernel):
        for dev_cache in kern.device_caches.values():
            for c in list(dev_cache[0].values())[:16]:
                print(kern.fn.__name__, "regs", c.n_regs, "spills", c.n_spills)
except Exception as e:  # noqa: BLE001
    print("no compiled-kernel info:", e)
