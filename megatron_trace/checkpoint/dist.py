"""Megatron distributed checkpoints (torch_dist format) of a TraceGPTModel, and reading them back
as full tensors in one process.

`save_model` / `load_model` run on every rank: a checkpoint saved under one TP/EP/PP layout
loads under any other (Megatron stores global tensors; each rank reads its slices).
`iter_full_tensors` needs no process group: it reads one full tensor at a time, under the
full-state-dict names of `megatron.weights` (what a one-process model's `state_dict()` holds).

On-disk layout written by megatron-core 0.19.2 (L layers, E experts, F = moe_intermediate_size,
H = hidden_size; `.metadata` is torch.distributed.checkpoint's, `metadata.json` Megatron's):

| stored key | shape | full names |
|---|---|---|
| embedding.word_embeddings.weight, output_layer.weight, decoder.final_layernorm.weight | as full | the same |
| decoder.layers.{rest} | [L, *full] | decoder.layers.{l}.{rest} = [l] |
| decoder.layers.mlp.experts.experts.linear_fc1.weight | [L, E, 2F, H] | ...local_experts.{e}.linear_fc1.weight = [l, e] |
| decoder.layers.mlp.experts.experts.linear_fc2.weight | [L, E, H, F] | ...local_experts.{e}.linear_fc2.weight = [l, e] |
| */_extra_state/shard_*, common_state/shard_* | bytes | none (skipped) |

Layers are stacked along a leading global-layer axis, experts along a global-expert axis;
tensor-parallel slices are stored concatenated, and Megatron's SwiGLU factory stores each fc1
shard's gate and up halves so that the global fc1 is [gate; up] over all of F, exactly the
full tensor. Sequential and grouped expert modules store the same keys.
"""  # noqa: E501 - the rows of the Markdown table above cannot wrap

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from ..model_config import ModelConfig

CONFIG_FILE = "trace_model.json"

# Megatron stacks identical layers along a leading axis (no layer number in the key); a model
# whose layers differ (dense leading layers) keeps one key per layer, its experts still stacked
_EXPERTS = re.compile(r"^decoder\.layers\.mlp\.experts\.experts\.(linear_fc[12]\.weight)$")
_LAYERS = re.compile(r"^decoder\.layers\.([A-Za-z_][\w.]*)$")
_LAYER_EXPERTS = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.experts\.(linear_fc[12]\.weight)$")
_LAYER = re.compile(r"^decoder\.layers\.\d+\.[A-Za-z_][\w.]*$")
_TOP = re.compile(r"^(embedding|output_layer|decoder\.final_layernorm)\.[\w.]+$")
_SKIPPED_BYTES = re.compile(r"(^common_state|\._extra_state)/shard_[\d._]+$")


# ---- saving and loading under a parallel layout ------------------------------------------------


def results_queue_in_process() -> None:
    """Megatron's filesystem writer reports its results through a `multiprocessing.Manager`
    queue: a server process, spawned at the first save, that outlives a killed trainer (an
    orphan importing torch, one per rank). `save_model` saves synchronously, so the writes run on
    threads of this process and a plain thread-safe queue carries the same results."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_model(model: torch.nn.Module, model_cfg: ModelConfig, directory: str | os.PathLike,
               extra_files: dict[str, dict] | None = None) -> None:
    """Save this rank's part of `model` (built from `cfg`) to `directory`; call on every rank.
    `extra_files` (name -> JSON-able dict) are written beside it by rank 0, before the rename.

    All ranks write into a sibling `<directory>.tmp-<token>` that rank 0 renames to `directory`
    once every rank has finished, so a partial checkpoint never sits at `directory` (a failed
    save leaves the temporary directory behind). `trace_model.json` records `cfg`.

    Raises:
        FileExistsError: `directory` exists (on every rank, before anything is written).
        ValueError: `cfg` does not describe `model`, or the model has state outside its
            sharded tensors (which `iter_full_tensors` could not see).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    _check_config(model_cfg, model, "the config to save")
    directory = Path(directory)
    # rank 0 decides for all, so that no rank waits at a barrier another rank has left
    decision = [None, None]
    if torch.distributed.get_rank() == 0:
        if directory.exists():
            decision[0] = f"{directory} exists; a checkpoint is never saved over another"
        else:
            decision[1] = directory.with_name(f"{directory.name}.tmp-{uuid.uuid4().hex[:12]}")
            decision[1].mkdir(parents=True)
    torch.distributed.broadcast_object_list(decision, src=0)
    if decision[0]:
        raise FileExistsError(decision[0])
    tmp = decision[1]

    sharded = model.sharded_state_dict()
    plain = [k for k, v in sharded.items() if not isinstance(v, ShardedBase)]
    if plain:
        raise ValueError(f"state outside sharded tensors would go to Megatron's common state: {plain}")
    results_queue_in_process()
    dist_checkpointing.save(sharded, str(tmp))
    if torch.distributed.get_rank() == 0:
        for name, content in {CONFIG_FILE: dataclasses.asdict(model_cfg), **(extra_files or {})}.items():
            (tmp / name).write_text(json.dumps(content, indent=1) + "\n")
    torch.distributed.barrier()  # every rank's files are written
    if torch.distributed.get_rank() == 0:
        if directory.exists():  # appeared while saving; os.rename would replace an empty one
            raise FileExistsError(f"{directory} appeared while saving; the checkpoint stays in {tmp}")
        tmp.rename(directory)
    torch.distributed.barrier()  # no rank returns before the checkpoint is in place


def load_model(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load the checkpoint at `directory` into this rank's `model`; call on every rank.

    The model may be built under any TP/EP/PP layout and with either expert module. Every
    parameter must be in the checkpoint and every checkpoint tensor must be wanted by some rank.

    Raises:
        FileNotFoundError: `directory` holds no checkpoint. ValueError: its config differs
            from the model's (naming the field).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _check_config(read_config(directory), model, f"the checkpoint at {directory}")
    _require(directory, "metadata.json")  # Megatron's marker of a finished checkpoint
    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory), strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state, strict=True)


def read_config(directory: str | os.PathLike) -> ModelConfig:
    """The ModelConfig a checkpoint was saved with (its trace_model.json)."""
    path = _require(directory, CONFIG_FILE)
    return ModelConfig(**json.loads(path.read_text()))


def _require(directory: str | os.PathLike, name: str) -> Path:
    """directory/name, or FileNotFoundError saying that `directory` holds no checkpoint."""
    path = Path(directory) / name
    if not path.is_file():
        what = "does not exist" if not Path(directory).exists() else f"has no {name}"
        raise FileNotFoundError(f"no TRACE checkpoint at {directory}: it {what}")
    return path


def _check_config(model_cfg: ModelConfig, model: torch.nn.Module, what: str) -> None:
    """ValueError naming the first ModelConfig field in which `model_cfg` differs from the one the
    model was built from (`build_model` keeps it as `model.model_cfg`)."""
    built = model.model_cfg
    for field in dataclasses.fields(ModelConfig):
        if getattr(model_cfg, field.name) != getattr(built, field.name):
            raise ValueError(f"{what} has {field.name}={getattr(model_cfg, field.name)!r}, "
                             f"the model {getattr(built, field.name)!r}")


# ---- full tensors in one process ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where a full tensor lies: stored `key`, its index along the stacked axes, its shape/dtype."""

    key: str
    index: tuple[int, ...]  # (layer,) or (layer, expert), or () for an unstacked tensor
    shape: tuple[int, ...]
    dtype: torch.dtype


def _metadata(directory: str | os.PathLike) -> Metadata:
    _require(directory, ".metadata")
    return FileSystemReader(str(directory)).read_metadata()


def _entries(md: Metadata) -> dict[str, _Entry]:
    """Full name -> _Entry for every tensor of the checkpoint.

    Raises ValueError for a stored item not in the layout above (so none is dropped silently).
    """
    out: dict[str, _Entry] = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            if not _SKIPPED_BYTES.search(key):
                raise ValueError(f"checkpoint item {key!r} is not a tensor and not extra/common state")
            continue
        shape, dtype = tuple(item.size), item.properties.dtype
        if m := _EXPERTS.match(key):
            layers, experts, *rest = shape
            for layer in range(layers):
                for e in range(experts):
                    name = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{m.group(1)}"
                    out[name] = _Entry(key, (layer, e), tuple(rest), dtype)
        elif (m := _LAYERS.match(key)) and ".experts." not in key:
            for layer in range(shape[0]):
                out[f"decoder.layers.{layer}.{m.group(1)}"] = _Entry(key, (layer,), shape[1:], dtype)
        elif m := _LAYER_EXPERTS.match(key):
            experts, *rest = shape
            for e in range(experts):
                name = f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{e}.{m.group(2)}"
                out[name] = _Entry(key, (e,), tuple(rest), dtype)
        elif _LAYER.match(key) and ".experts." not in key or _TOP.match(key):
            out[key] = _Entry(key, (), shape, dtype)
        else:
            raise ValueError(f"checkpoint tensor {key!r} {list(shape)} is not in a layout this reader knows")
    return out


def full_tensor_names(directory: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{full name: (shape, dtype)} of every tensor in the checkpoint, from its metadata alone."""
    return {name: (e.shape, e.dtype) for name, e in _entries(_metadata(directory)).items()}


def iter_full_tensors(directory: str | os.PathLike,
                      names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (full name, full tensor) for every tensor of the checkpoint, or for `names` in order.

    One process, no process group; memory is about one full tensor (each read touches only the
    stored chunks that overlap it). Tensors keep their stored dtype (bf16 matrices, fp32 norms).

    Raises (at the call, before anything is read):
        FileNotFoundError: no checkpoint at `directory`. KeyError: a name not in it.
        ValueError: a stored item this reader does not understand.
    """
    md = _metadata(directory)
    entries = _entries(md)
    names = list(entries) if names is None else list(names)
    missing = [n for n in names if n not in entries]
    if missing:
        raise KeyError(f"not in the checkpoint at {directory}: {missing}")
    reader = FileSystemReader(str(directory))
    reader.set_up_storage_reader(md, True)
    return ((name, _read(reader, md, entries[name])) for name in names)


class _RegionPlanner(DefaultLoadPlanner):
    """Points every read item at the part of `buffer` it fills (item offsets are relative to
    the region `buffer` holds; the default planner would look the region up in a state dict)."""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.buffer = buffer

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.buffer


def _read(reader: FileSystemReader, md: Metadata, entry: _Entry) -> torch.Tensor:
    """The region of `entry.key` at `entry.index` (leading axes) as a tensor of `entry.shape`."""
    lead = len(entry.index)
    region = ChunkStorageMetadata(offsets=torch.Size(entry.index + (0,) * len(entry.shape)),
                                  sizes=torch.Size((1,) * lead + entry.shape))
    out = torch.empty(region.sizes, dtype=entry.dtype)
    items = create_read_items_for_chunk_list(entry.key, md.state_dict_metadata[entry.key], [region])
    if sum(torch.Size(i.lengths).numel() for i in items) != out.numel():  # stored chunks never overlap
        raise ValueError(f"checkpoint tensor {entry.key!r} lacks part of the region at {entry.index}")
    reader.read_data(LoadPlan(items), _RegionPlanner(out)).wait()
    return out.reshape(entry.shape)
