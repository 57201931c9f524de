#!/usr/bin/env bash
# Builds the bundle that gets Transformer Engine 2.20.2 onto the GPU machine (H200, Python 3.12,
# torch 2.11.0+cu130, nvcc 13.0, no network). Run it here, in the project root:
#   bash bench/te_h200/build_bundle.sh .te      # .te is ignored by git
# .te/whl: TE's Python (`transformer_engine`), the extension's source (`transformer_engine_torch`,
# built there against the image's torch and CUDA) and what the image lacks (pydantic & co,
# nvdlfw-inspect, cudnn-frontend's headers); .te/core.partNN: TE's core wheel (264 MiB) in pieces
# of 45 MiB (the tree itself is 14 MiB of the 64 a call), each carried by a call of its own onto one warm machine (bench/gpu_te.sh part);
# .te/SHA256: the core wheel's checksum, checked after the pieces are joined there.
set -euo pipefail
out=${1:-.te}; mkdir -p "$out/whl"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$1" "${@:2}"; }
dl "$out/whl" transformer_engine==2.20.2 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 \
  typing_inspection==0.4.5 nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0
# the extension is source only on PyPI
url=$(curl -s https://pypi.org/simple/transformer-engine-torch/ | grep -o 'https://[^"#]*transformer_engine_torch-2.20.2.tar.gz' | head -n 1)
curl -s -o "$out/whl/transformer_engine_torch-2.20.2.tar.gz" "$url"
tmp=$(mktemp -d); dl "$tmp" transformer_engine_cu13==2.20.2
core=$(ls "$tmp"/transformer_engine_cu13-2.20.2-*.whl)
basename "$core" > "$out/CORE_NAME"
(cd "$tmp" && sha256sum "$(basename "$core")") > "$out/SHA256"
rm -f "$out"/core.part*
split -b 45M -d "$core" "$out/core.part"
rm -rf "$tmp"
ls -la "$out" "$out/whl"; du -sh "$out"
