#!/usr/bin/env bash
# Builds the wheel bundle that lets SGLang 0.5.17 run on the GPU machine (H200, Python 3.12,
# torch 2.11.0+cu130, no network). Run it on your own machine, in the project root:
#   bash bench/sglang_h200/build_bundle.sh .sgl      # then carry .sgl (ignored by git)
# It downloads the pinned wheels (wheels.txt), and a slim sglang-kernel 0.4.5: the sm90 ops and
# the Python files only (no flash_ops 1.1 GB, no sm100 build), and sglang without its diffusion
# runtime and gRPC extension: about 54 MiB in all.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-.sgl}; mkdir -p "$out/whl"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$1" "${@:2}"; }
dl "$out/whl" -r "$here/wheels.txt"
tmp=$(mktemp -d); dl "$tmp" sglang-kernel==0.4.5
python3 "$here/slim_wheel.py" "$tmp"/sglang_kernel-0.4.5-*.whl "$out/whl" \
  sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/ sgl_kernel/infllm_ops sgl_kernel/flashmla_ops.abi3.so
# sglang itself without what an Engine run never imports (the diffusion runtime, the gRPC
# server's extension), so that megatron-core and torch_memory_saver fit beside it in one call
mv "$out"/whl/sglang-0.5.17-*.whl "$tmp"/
python3 "$here/slim_wheel.py" "$tmp"/sglang-0.5.17-*.whl "$out/whl" sglang/multimodal_gen/ sglang/srt/grpc/_core \
  | grep -v "^dropped"
rm -rf "$tmp"
cp "$here/sitecustomize.py" "$here/run.sh" "$out/"
du -sh "$out"
