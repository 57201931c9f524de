"""TRACE kernels (import name `trace_kernels`): the one implementation of the FP4 numerics."""
