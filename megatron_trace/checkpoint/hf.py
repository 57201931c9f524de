"""An HF Qwen3-MoE checkpoint directory seen as a full Megatron state dict, read lazily.

Opening checks the whole directory against its config.json from the file headers alone (every
expected tensor present, nothing unexpected, every shape right) and names what is wrong; a
tensor is read only when it is asked for, so a rank of a parallel conversion reads the tensors
it needs, one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch

from ..model_config import full_weight_shapes
from .hf_layout import config_from_hf, hf_parts, hf_shapes, to_megatron
from .safetensors_io import SafetensorsDir

# which config.json fields decide each HF tensor's shape (named in shape errors)
_SHAPE_FIELDS = {"embed_tokens": "vocab_size, hidden_size", "lm_head": "vocab_size, hidden_size",
                 "q_proj": "num_attention_heads, head_dim, hidden_size",
                 "k_proj": "num_key_value_heads, head_dim, hidden_size",
                 "v_proj": "num_key_value_heads, head_dim, hidden_size",
                 "o_proj": "hidden_size, num_attention_heads, head_dim", "norm": "hidden_size or head_dim",
                 "layernorm": "hidden_size", "gate.": "num_experts, hidden_size",
                 "proj.": "moe_intermediate_size, hidden_size"}


def _fields(name: str) -> str:
    return next((f for key, f in _SHAPE_FIELDS.items() if key in name), "")


class HFCheckpoint(Mapping):
    """Full Megatron name -> tensor (as stored: the checkpoint's dtype), from an HF directory.

    Attributes: `hf_config` (config.json as a dict), `cfg` (the ModelConfig read from it).
    Raises (at construction) FileNotFoundError / ValueError naming the missing directory, file,
    tensor, unexpected tensor, or the tensor whose shape disagrees with config.json.
    """

    def __init__(self, path: str | os.PathLike):
        self.dir = SafetensorsDir(path)
        self.hf_config = self.dir.json("config.json")
        self.model_cfg = config_from_hf(self.hf_config)
        want = hf_shapes(self.model_cfg)
        missing = sorted(set(want) - set(self.dir.names))
        unknown = sorted(set(self.dir.names) - set(want))
        if missing:
            raise ValueError(f"{path}: {len(missing)} tensors that config.json implies are missing, e.g. {missing[0]}")
        if unknown:
            raise ValueError(f"{path}: {len(unknown)} tensors that a {self.model_cfg.model_type} model with this "
                             f"config.json does not have, "
                             f"e.g. {unknown[0]} (not converted: nothing is dropped silently)")
        for name, shape in want.items():
            if self.dir.shapes[name] != shape:
                raise ValueError(f"{path}: {name} has shape {self.dir.shapes[name]} but config.json "
                                 f"({_fields(name)}) implies {shape}")
        self._names = list(full_weight_shapes(self.model_cfg))

    def __getitem__(self, name: str) -> torch.Tensor:
        parts = [self.dir.get(hf_name) for hf_name, _ in hf_parts(name, self.model_cfg)]
        return to_megatron(name, parts, self.model_cfg)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
