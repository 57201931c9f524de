"""How the trainer's weights travel to SGLang's scheduler processes: TRACE's self-describing
weight buckets (`megatron_trace.weight_buckets`: one flat uint8 tensor each, whole weights or
slices, packed FP4 or plain), one bucket per SGLang weight call, under a name that carries the
update's version and the bucket's place in it. Both sides import this module (it imports no
SGLang).

Colocated, a bucket is pickled once per SGLang tensor-parallel rank in the process that holds it
(`serialize_bucket`: a CUDA bucket by IPC handle, a CPU one through shared memory), and the
scheduler processes map it: one handle per bucket, not one per tensor, and no copy through the
engine's host process. Disaggregated, it is one broadcast over the weight group.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from megatron_trace.model_config import ModelConfig, fp4_site_of, full_weight_shapes
from megatron_trace.weight_buckets import Buckets, Coverage, Piece, Source, amax_of, read_bucket
from trace_kernels.fp4 import QTensor

MODEL_ENV = "TRACE_SGLANG_MODEL"  # TRACE's ModelConfig (JSON) for the scheduler processes' weight loader
PACKED_AT_START = "TRACE_SGLANG_PACKED_AT_START"  # "1": dummy start, FP4 sites created packed (quant.packed_at_start)
LOADER = "sglang_rollout.sglang.weights.load_trace_weights"  # SGLang's custom_weight_loader name
_BUCKET = re.compile(r"trace-bucket/v(\d+)/(\d+)")
_DEVICE_ARG = 6  # the device index in torch's rebuild_cuda_tensor arguments (SGLang's patch reads a UUID there)


def bucket_name(version: int, index: int) -> str:
    """The name a bucket travels under: bucket `index` (from 0) of the update to `version`."""
    return f"trace-bucket/v{version}/{index}"


def parse_bucket_name(name: str) -> tuple[int, int]:
    """(version, index) of `bucket_name`'s name. ValueError for any other name."""
    m = _BUCKET.fullmatch(name)
    if m is None:
        raise ValueError(f"weight update: {name!r} is not a TRACE weight bucket (trace-bucket/v<version>/<index>)")
    return int(m[1]), int(m[2])


def packs(fp4: bool):
    """name -> whether an engine (FP4 or not) holds that weight packed."""
    return lambda name: fp4 and fp4_site_of(name) is not None


def check_update(model_cfg: ModelConfig, state_dict: dict, fp4: bool) -> None:
    """ValueError naming the first tensor of a (partial or full) Megatron state dict that does not
    fit the model: an unknown name, another shape, or FP4 where the engine holds none."""
    coverage = Coverage(full_weight_shapes(model_cfg), packs(fp4))
    for name, t in state_dict.items():
        coverage.check(Piece.whole(name, t))


def state_dict_buckets(model_cfg: ModelConfig, state_dict: dict, max_bytes: int, fp4: bool) -> Buckets:
    """A (partial or full) state dict as weight buckets of at most max_bytes: QTensors packed, plain
    weights as they are (an FP4 engine quantizes a whole BF16 weight on receipt); a plain weight
    the FP4 engine packs that does not fit in one bucket is packed on the way (the receiver can
    quantize only whole tensors: the global scale is over all of it)."""
    packed, sources = packs(fp4), []
    for name, t in state_dict.items():
        piece = Piece.whole(name, t)
        if packed(name) and not isinstance(t, QTensor) and len(piece.split(max_bytes)) > 1:  # it would be sliced
            sources.append(Source(Piece(name, "nvfp4", 0, 0, piece.shape, piece.shape), t, amax_of(t)))
        else:
            sources.append(Source(piece, t))
    return Buckets(sources, max_bytes)


def checked(buckets: Iterable[torch.Tensor], coverage: Coverage, complete: bool) -> Iterator[tuple[torch.Tensor, bool]]:
    """(bucket, is_last) for each bucket, each checked against `coverage` before it is handed on
    (ValueError naming the weight); with `complete`, the update is also checked complete before
    its last bucket goes, so an incomplete update never becomes the engine's version."""
    it = iter(buckets)
    flat = next(it, None)
    while flat is not None:
        following = next(it, None)
        coverage.add(read_bucket(flat))
        if following is None and complete:
            coverage.check_complete()
        yield flat, following is None
        flat = following


def serialize_bucket(name: str, flat: torch.Tensor, ranks: int) -> list[bytes]:
    """`[(name, flat)]` pickled for each of `ranks` scheduler processes (SGLang's
    update_weights_from_tensor payloads, one per tensor-parallel rank so that each maps its own
    reference). A CUDA tensor is named by its device's UUID, as SGLang's own serializer names it
    (the receiving process may number the GPUs differently)."""
    out = []
    for _ in range(ranks):
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table[torch.Tensor] = _reduce_tensor  # a copy of torch's reducers, made per pickler
        pickler.dump([(name, flat)])
        out.append(buf.getvalue())
    return out


def _reduce_tensor(t: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
                *args[_DEVICE_ARG + 1:])
    return rebuild, args
