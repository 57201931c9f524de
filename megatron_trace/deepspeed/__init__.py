"""The DeepSpeed trainer backend: transformers' Qwen3-MoE trained under DeepSpeed ZeRO with
TRACE's FP4 QAT and guidance (`model`: the FP4 sites in the HF modules)."""
