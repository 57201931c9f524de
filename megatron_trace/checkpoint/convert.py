"""HF Qwen3-MoE checkpoints <-> Megatron distributed checkpoints, and the FP4 export of either.

HF -> Megatron starts one process per rank of the requested TP/EP/PP layout (gloo on the CPU,
NCCL with a GPU per rank where CUDA is present); each rank builds its stage of the model, reads
only the HF tensors it holds a slice of (one at a time) and writes its shards of the
distributed checkpoint, which any other layout can load. The HF config.json travels inside the
Megatron checkpoint (`hf_config.json`) so the way back writes the same file; hyper-parameters
always come from it.

Megatron -> HF and the FP4 export stream one full tensor at a time in one process.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from ..model_config import ModelConfig, full_weight_shapes
from . import dist
from .hf import HFCheckpoint
from .hf_layout import config_from_hf, hf_config, hf_dtype, stored_dtype, to_hf
from .safetensors_io import ShardedWriter

HF_CONFIG = "hf_config.json"


def layout_world(tp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1) -> dict:
    """The smallest Megatron layout with these sizes: {tp, ep, pp, etp, dp} (dp fills the rest)."""
    for name, v in (("tp", tp), ("ep", ep), ("pp", pp), ("etp", etp)):
        if v < 1:
            raise ValueError(f"--{name} must be >= 1, got {v}")
    return {"tp": tp, "ep": ep, "pp": pp, "etp": etp, "dp": math.lcm(tp, ep * etp) // tp}


def check_layout(model_cfg: ModelConfig, layout: dict) -> None:
    """ValueError naming the parallel size that does not divide the model dimension it splits."""
    for size, dim, what in ((layout["tp"], model_cfg.num_attention_heads, "num_attention_heads"),
                            (layout["tp"], model_cfg.num_key_value_heads, "num_key_value_heads"),
                            (layout["ep"], model_cfg.num_experts, "num_experts"),
                            (layout["pp"], model_cfg.num_layers, "num_layers"),
                            (layout["etp"], model_cfg.moe_intermediate_size // 16, "moe_intermediate_size / 16")):
        if dim % size:
            raise ValueError(f"layout {layout}: {what}={dim} is not divisible by {size}")


def _convert_rank(rank: int, hf_dir: str, out: str) -> None:
    from ..megatron.model import build_model
    from ..megatron.weights import load_full_state_dict

    ckpt = HFCheckpoint(hf_dir)
    model = build_model(ckpt.model_cfg, "bf16")
    load_full_state_dict(model, ckpt)
    dist.save_model(model, ckpt.model_cfg, out, extra_files={HF_CONFIG: ckpt.hf_config})


def hf_to_megatron(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, ep: int = 1, pp: int = 1,
                   etp: int = 1) -> Path:
    """Convert an HF checkpoint directory into a Megatron distributed checkpoint at `out`, written
    under the layout (tp, ep, pp, etp). The whole directory is checked against its config.json
    first. Weights are cast to the model's BF16 parameters."""
    from ..megatron.spawn import spawn

    ckpt = HFCheckpoint(hf_dir)  # headers only: fails fast, naming the problem
    layout = layout_world(tp, ep, pp, etp)
    check_layout(ckpt.model_cfg, layout)
    if Path(out).exists():
        raise FileExistsError(f"output {out} already exists")
    spawn(_convert_rank, layout, hf_dir=str(hf_dir), out=str(out))
    return Path(out)


def megatron_configs(meg_dir: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """(ModelConfig, HF config.json dict) of a Megatron checkpoint. The HF config it carries is
    the source of truth; one that disagrees with the checkpoint's model config is an error naming
    the field. Checkpoints trained from a preset get a generated HF config."""
    cfg = dist.read_config(meg_dir)
    path = Path(meg_dir) / HF_CONFIG
    if not path.exists():
        return cfg, hf_config(cfg)
    hf = json.loads(path.read_text())
    from_hf = config_from_hf(hf)
    for field, value in vars(cfg).items():
        if getattr(from_hf, field) != value:
            raise ValueError(f"{meg_dir}: {HF_CONFIG} has {field}={getattr(from_hf, field)!r} but the checkpoint's "
                             f"model was saved with {field}={value!r}")
    return cfg, hf


def megatron_tensors(meg_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(full name, tensor) of every weight of a Megatron checkpoint, one at a time, after checking
    that the checkpoint holds exactly the weights its config implies (with their shapes)."""
    cfg = dist.read_config(meg_dir)
    want, have = full_weight_shapes(cfg), dist.full_tensor_names(meg_dir)
    if missing := sorted(set(want) - set(have)):
        raise ValueError(f"{meg_dir}: {len(missing)} weights missing, e.g. {missing[0]}")
    if extra := sorted(set(have) - set(want)):
        raise ValueError(f"{meg_dir}: {len(extra)} tensors the model config does not have, e.g. {extra[0]}")
    for name, shape in want.items():
        if tuple(have[name][0]) != shape:
            raise ValueError(f"{meg_dir}: {name} has shape {tuple(have[name][0])}, the model config implies {shape}")
    return dist.iter_full_tensors(meg_dir, list(want))


def megatron_to_hf(meg_dir: str | os.PathLike, out: str | os.PathLike, max_shard_bytes: int = 2 << 30,
                   overwrite: bool = False) -> Path:
    """Write a Megatron distributed checkpoint as an HF directory (sharded safetensors, index,
    config.json), one tensor at a time; the directory appears complete or not at all."""
    cfg, hf = megatron_configs(meg_dir)
    dtype = hf_dtype(hf)
    with ShardedWriter(out, max_shard_bytes, overwrite) as writer:
        for name, tensor in tqdm(megatron_tensors(meg_dir), total=len(full_weight_shapes(cfg)),
                                 desc="megatron -> hf", unit="tensor"):
            if name == "output_layer.weight" and cfg.tie_word_embeddings:
                continue
            for hf_name, part in to_hf(name, tensor.to(stored_dtype(name, dtype)), cfg):
                writer.add(hf_name, part)
        return writer.close({"config.json": hf})
