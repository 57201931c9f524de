"""Transformer Engine front end of the trainer (`trainer.transformer_impl=transformer_engine`).

`roles` reads the quantizer roles a TE `CustomRecipe` factory is called with (TE 2.9-2.15
strings, 2.16+ `QuantizerRole`) into what TRACE's recipe does with each slot; `nvfp4_storage` lays
TRACE's NVFP4 codes and scales out as TE's native `NVFP4TensorStorage` (what cuBLAS's FP4 GEMM
reads on Blackwell); both run without TE. `recipe` (imports TE) is the factory Megatron's
`fp4_quantizer_factory` names and its quantizers, subclasses of TE's `IdentityQuantizer` holding
TRACE's fake-quantized values at the FP4 site of the module running; `spec` (imports TE and
Megatron's TE extension) is the layer spec on TE's linears. All are tested on the CPU against TE
2.20.2's own classes (`tests/support/te_cpu.py`); TE's modules themselves need its extension on a
GPU (docs/notes/te-fp4-recipe.md, bench/gpu_te.sh).
"""
