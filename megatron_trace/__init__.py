"""TRACE trainer side: guidance, Megatron-core integration, RL loop (built up issue by issue)."""
