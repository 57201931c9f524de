"""Checkpoint formats: the HF Qwen3-MoE layout and the full (one-process Megatron) layout."""
