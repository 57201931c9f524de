"""Runs at the start of every Python process whose PYTHONPATH holds this folder: SGLang's scheduler
and detokenizer processes of a CPU engine (`SGLangEngine` sets it). Applies
sglang_rollout.sglang.cpu_patches (a no-op where CUDA is present)."""

from sglang_rollout.sglang.cpu_patches import install

install()
