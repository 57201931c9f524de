"""How the trainer's weights travel to SGLang's scheduler processes: (name, tensor) pairs under
Megatron's full names, a packed FP4 weight (QTensor) as its parts "<name>::codes",
"<name>::scales", "<name>::g". Both sides import this module (it imports no SGLang); the flat
buffers they travel in are `megatron_trace.weight_buckets`' layout (bucket_layout, pack_bucket)."""

from __future__ import annotations

import torch

from megatron_trace.model_config import ModelConfig, fp4_site_of, full_weight_shapes
from megatron_trace.weight_buckets import Coverage, Piece
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
    coverage = Coverage(full_weight_shapes(model_cfg), lambda name: fp4 and fp4_site_of(name) is not None)
    for name, t in state_dict.items():
        coverage.check(Piece.whole(name, t))


def buckets(state_dict: dict, max_bytes: int) -> list[dict]:
    """`state_dict` cut into consecutive parts of at most max_bytes each (a tensor larger than
    that alone; a packed FP4 weight's parts stay together)."""
    out, size = [{}], 0
    for name, t in state_dict.items():
        nbytes = (t.codes.nbytes + t.block_scales.nbytes + 4) if isinstance(t, QTensor) else t.nbytes
        if out[-1] and size + nbytes > max_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += nbytes
    return [b for b in out if b]
