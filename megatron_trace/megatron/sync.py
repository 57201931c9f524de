"""Weight sync from the Megatron trainer (docs/design.md section 5, step 1): the weights to the
engines, sharded.

No rank holds the whole model. Each trainer rank sends the weights it is the first replica of
(`megatron.weights.held_slices`): dense weights from data-parallel rank 0, every tensor-parallel
rank its own slice (replicated ones from tensor-parallel rank 0); experts from
expert-data-parallel rank 0, every expert-TP rank its slice. For an FP4 engine the FP4 sites
are packed on the way by the shared quantizer with the global scale of the whole logical
tensor (MLA's down projections: of both, one global scale), as the trainer's forward quantizes
them (`megatron.qat`): every rank's slice amaxes are
reduced in ONE all-reduce over the trainer ranks before anything is sent, so no collective
runs between the point-to-point sends, and the codes are those of quantizing the full tensor
in one process. Buckets (`megatron_trace.weight_buckets`) are made one at a time as they are iterated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model_config import FP4_WEIGHT_SUFFIXES, fp4_weight_peers, full_weight_shapes
from ..weight_buckets import Buckets, Piece, Source, amax_of
from .qat import all_reduce_max
from .weights import global_name, held_slices


def trainer_buckets(model: torch.nn.Module, fp4: bool, max_bytes: int) -> Buckets:
    """This rank's share of the weights (see the module docstring) as buckets, made as they are
    iterated. Collective over the trainer ranks (the amax all-reduce): call on every rank."""
    held, amax = [], {}
    for local, param in model.state_dict(keep_vars=True).items():
        if local.endswith("_extra_state"):
            continue
        name, values = global_name(local, model), param.detach()
        slices = held_slices(name, values)
        if not slices:  # another replica sends it
            continue
        packed = fp4 and name.endswith(FP4_WEIGHT_SUFFIXES)
        kind = "nvfp4" if packed else "bfloat16" if values.dim() == 2 else str(values.dtype).removeprefix("torch.")
        held += [(Piece(name, kind, dim, start, tuple(part.shape), full), part) for dim, start, full, part in slices]
        if packed:
            amax[name] = amax_of(values)
    amax = _whole_tensor_amax(amax, model.model_cfg)
    return Buckets([Source(piece, part, amax.get(piece.name)) for piece, part in held], max_bytes)


def _whole_tensor_amax(amax: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """{name: the global-scale amax of the logical tensor} from this rank's slices' {name: amax}:
    one MAX all-reduce over the trainer ranks of a vector with a slot per FP4 weight of the model
    (0 where a rank holds none of it; amaxes are >= 0), then the max over each weight's peers
    (`fp4_weight_peers`: MLA's down projections share one global scale, as `FP4Site.weight_peers`)."""
    whole = dict(amax)
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [n for n in full_weight_shapes(model_cfg) if n.endswith(FP4_WEIGHT_SUFFIXES)]
        slot = {n: i for i, n in enumerate(names)}
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
        vec = torch.zeros(len(names), dtype=torch.float32, device=dev)
        if amax:
            vec[torch.tensor([slot[n] for n in amax], device=dev)] = torch.stack(list(amax.values())).to(dev)
        all_reduce_max(vec, dist.group.WORLD)  # a NaN or Inf anywhere is Inf here (amax_of), on every rank
        bad = torch.nonzero(~torch.isfinite(vec)).flatten().tolist()
        if bad:  # every rank stops here, before any send
            raise ValueError(f"weight sync: {len(bad)} FP4 weights hold NaN or Inf, e.g. {[names[i] for i in bad[:5]]}")
        whole = dict(zip(names, vec, strict=True))
    return {name: torch.stack([whole[p] for p in fp4_weight_peers(name, model_cfg) or (name,)]).amax() for name in amax}
