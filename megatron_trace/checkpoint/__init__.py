"""Checkpoints: HF checkpoints of the three families (`hf`, `hf_layout`), Megatron distributed checkpoints
(`dist`), conversions between them (`convert`), final FP4 exports (`fp4_export`), the
quantization audit (`audit`), streaming safetensors I/O (`safetensors_io`) and the tools'
command lines (`cli`)."""
