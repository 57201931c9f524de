"""TRACE rollout side: built-in FP4 engine and the SGLang backend (built up issue by issue)."""
