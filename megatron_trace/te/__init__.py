"""Transformer Engine front end of the trainer (issue 26, in progress).

What is here runs without TE: `roles` reads the quantizer roles a TE `CustomRecipe` factory is
called with (TE 2.9-2.15 strings, 2.16+ `QuantizerRole`) into what TRACE's recipe does with each
slot, and `nvfp4_storage` lays TRACE's NVFP4 codes and scales out as TE's native
`NVFP4TensorStorage` (what cuBLAS's FP4 GEMM reads on Blackwell). `recipe` (imports TE) is the
factory Megatron's `fp4_quantizer_factory` names and its quantizers, subclasses of TE's
`IdentityQuantizer` holding TRACE's fake-quantized values. All are tested on the CPU against TE
2.20.2's own classes (`tests/support/te_cpu.py`); running them inside TE's modules needs TE's
extension, built on a GPU machine (docs/notes/te-fp4-recipe.md), which has not been done yet.
"""
