"""How the trainer's weights travel to SGLang's scheduler processes: (name, tensor) pairs under
Megatron's full names, a packed FP4 weight (QTensor) as its parts "<name>::codes",
"<name>::scales", "<name>::g". Both sides import this module (it imports no SGLang)."""

from __future__ import annotations

import torch

from megatron_trace.model_config import ModelConfig, fp4_site_of, full_weight_shapes
from trace_kernels.fp4 import Format, QTensor

PART = "::"
MODEL_ENV = "TRACE_SGLANG_MODEL"  # TRACE's ModelConfig (JSON) for the scheduler processes' weight loader
LOADER = "sglang_rollout.sglang.weights.load_trace_weights"  # SGLang's custom_weight_loader name


def flatten(state_dict: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a state dict whose FP4 sites may be QTensors (split into parts)."""
    out = []
    for name, t in state_dict.items():
        if isinstance(t, QTensor):
            out += [(name + PART + "codes", t.codes), (name + PART + "scales", t.block_scales.view(torch.uint8)),
                    (name + PART + "g", t.global_scale.reshape(1).float())]
        else:
            out.append((name, t))
    return out


def unflatten(named: list[tuple[str, torch.Tensor]], shapes: dict) -> dict:
    """The state dict `flatten` made, QTensors rebuilt (shapes: Megatron name -> logical shape)."""
    out, parts = {}, {}
    for name, t in named:
        base, sep, part = name.partition(PART)
        if sep:
            parts.setdefault(base, {})[part] = t
        else:
            out[name] = t
    for base, p in parts.items():
        if set(p) != {"codes", "scales", "g"} or base not in shapes:
            raise ValueError(f"weight update: {base}: a packed FP4 weight needs codes, scales and g "
                             f"of a known tensor, got {sorted(p)}")
        out[base] = QTensor(p["codes"], p["scales"].view(torch.float8_e4m3fn), p["g"].reshape(()).float(),
                            Format.NVFP4, torch.Size(shapes[base]))
    return out


def check_update(model_cfg: ModelConfig, state_dict: dict, fp4: bool) -> None:
    """ValueError naming the first tensor of a (partial or full) Megatron state dict that does not
    fit the model: an unknown name, another shape, or FP4 where the engine holds none."""
    shapes = full_weight_shapes(model_cfg)
    for name, t in state_dict.items():
        if name not in shapes:
            raise ValueError(f"weight update: unknown tensor {name!r}")
        if tuple(t.shape) != tuple(shapes[name]):
            raise ValueError(f"weight update: {name} has shape {tuple(t.shape)}, the model's is {tuple(shapes[name])}")
        if isinstance(t, QTensor) and (not fp4 or fp4_site_of(name) is None):
            raise ValueError(f"weight update: {name} arrived as FP4, but the engine holds it in BF16")
