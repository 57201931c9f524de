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


ALIGN = 16  # bytes: every tensor of a flat bucket starts at a multiple of this (any dtype's view)


def bucket_layout(dtypes: list, shapes: list) -> tuple[list[int], int]:
    """Byte offset of each tensor in a flat bucket, and the bucket's size (the same on both sides)."""
    offsets, size = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offsets.append(size)
        nbytes = torch.Size(shape).numel() * _dtype(dtype).itemsize
        size += -(-nbytes // ALIGN) * ALIGN
    return offsets, size


def pack_bucket(named: list[tuple[str, torch.Tensor]], device=None) -> tuple[torch.Tensor, list, list, list]:
    """One flat uint8 tensor holding `named`'s tensors (see bucket_layout), with their names,
    dtype names and shapes, for update_weights_from_distributed."""
    names = [n for n, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    offsets, size = bucket_layout(dtypes, shapes)
    device = device if device is not None else (named[0][1].device if named else "cpu")
    flat = torch.zeros(size, dtype=torch.uint8, device=device)
    for (_, t), start in zip(named, offsets, strict=True):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[start:start + raw.numel()].copy_(raw)
    return flat, names, dtypes, shapes


def unpack_bucket(flat: torch.Tensor, names: list, dtypes: list, shapes: list) -> list[tuple[str, torch.Tensor]]:
    """`pack_bucket`'s tensors, as views of `flat`."""
    offsets, size = bucket_layout(dtypes, shapes)
    if flat.numel() != size:
        raise ValueError(f"weight bucket of {flat.numel()} bytes, its {len(names)} tensors need {size}")
    out = []
    for name, dtype, shape, start in zip(names, dtypes, shapes, offsets, strict=True):
        dt = _dtype(dtype)
        n = torch.Size(shape).numel() * dt.itemsize
        out.append((name, flat[start:start + n].view(dt).reshape(shape)))
    return out


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


def _dtype(name) -> torch.dtype:
    dt = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight bucket: unknown dtype {name!r}")
    return dt
