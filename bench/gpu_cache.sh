#!/usr/bin/env bash
# The GPU machine's kernel caches across fresh machines. A fresh machine compiles every Triton
# kernel (SGLang's fused MoE and TRACE's FP4 kernels) and flashinfer's JIT kernels on first use:
# on 2026-12-05 SGLang BF16 took 177 s to start cold and 44 s warm at 48 layers, and two engines
# ran out of their time limits compiling. `save` packs the caches into $OUT (up to LIMIT_MIB,
# Triton's first); copy the archive into .gpucache/ here (ignored by git) and carry it, and
# `restore` unpacks it on the next fresh machine (harmless when stale: the caches key every
# kernel by its source and the compiler's version).
#   bash bench/gpu_cache.sh save       # at the end of a call on a warm machine
#   bash bench/gpu_cache.sh restore    # first thing on a fresh one (carry .gpucache)
set -uo pipefail
OUT=${OUT:-/tmp/out}; LIMIT_MIB=${LIMIT_MIB:-40}
dirs=(.triton/cache .cache/flashinfer .cache/tvm-ffi)
case ${1:-} in
  save)
    have=(); for d in "${dirs[@]}"; do [ -d "$HOME/$d" ] && have+=("$d"); done
    [ ${#have[@]} -eq 0 ] && { echo "gpu_cache: no cache to save"; exit 0; }
    for n in $(seq ${#have[@]} -1 1); do  # drop the last directories until the archive fits
      tar -C "$HOME" -czf "$OUT/gpu_cache.tar.gz" "${have[@]:0:n}"
      size=$(( $(stat -c %s "$OUT/gpu_cache.tar.gz") / 1048576 ))
      if [ "$size" -le "$LIMIT_MIB" ]; then echo "gpu_cache: saved ${have[*]:0:n} ($size MiB)"; exit 0; fi
      echo "gpu_cache: ${have[*]:0:n} take $size MiB (over $LIMIT_MIB)"
    done
    rm -f "$OUT/gpu_cache.tar.gz"; echo "gpu_cache: nothing fits $LIMIT_MIB MiB" ;;
  restore)
    if [ -f .gpucache/gpu_cache.tar.gz ]; then
      tar -C "$HOME" -xzf .gpucache/gpu_cache.tar.gz && echo "gpu_cache: restored $(du -sh .gpucache/gpu_cache.tar.gz | cut -f1)"
    else
      echo "gpu_cache: no .gpucache/gpu_cache.tar.gz carried: kernels compile on first use"
    fi ;;
  *) echo "usage: bash bench/gpu_cache.sh save|restore"; exit 2 ;;
esac
