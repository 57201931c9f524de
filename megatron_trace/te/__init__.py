"""Transformer Engine front end of the trainer (issue 26, in progress).

What is here runs without TE: `roles` reads the quantizer roles a TE `CustomRecipe` factory is
called with (TE 2.9-2.15 strings, 2.16+ `QuantizerRole`) into what TRACE's recipe does with each
slot, and `nvfp4_storage` lays TRACE's NVFP4 codes and scales out as TE's native
`NVFP4TensorStorage` (what cuBLAS's FP4 GEMM reads on Blackwell). Both are tested on the CPU
against TE 2.20.2's own classes (`tests/support/te_cpu.py`). The quantizer classes themselves
subclass TE's and need TE's extension, built on a GPU machine (docs/notes/te-fp4-recipe.md).
"""
