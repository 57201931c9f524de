"""Weight sync (docs/design.md section 5, step 1): the trainer's weights to the engine, FP4
sites packed by the shared quantizer when the engine runs FP4."""

from __future__ import annotations

from trace_kernels.fp4 import quantize

from ..megatron.weights import gather_full_state_dict
from ..model_config import FP4_WEIGHT_SUFFIXES
from ..modes import EnginePrecision
from .ranks import distributed_trainer


def sync_weights(trainer, engine, version: int) -> int:
    """Send the trainer's weights to the engine (a RolloutBackend) as `version`: FP4 sites packed
    with the shared quantizer (codes + scales) when the engine runs FP4, BF16 otherwise.
    Returns bytes sent. Across trainer ranks (call on all) the full weights are gathered on rank
    0, which sends them."""
    fp4 = EnginePrecision(engine.precision) is EnginePrecision.FP4
    if distributed_trainer():
        full = gather_full_state_dict(trainer)
        if full is None:  # not rank 0: rank 0 sends, every rank learns the version
            engine.update_weights(None, version)
            return 0
    else:
        full = {k: v for k, v in trainer.state_dict().items() if not k.endswith("_extra_state")}
    sd, nbytes = {}, 0
    for name, t in full.items():
        t = t.detach()
        if fp4 and name.endswith(FP4_WEIGHT_SUFFIXES):
            q = quantize(t, "nvfp4")
            sd[name], nbytes = q, nbytes + q.codes.numel() + q.block_scales.numel() + 4
        else:
            sd[name], nbytes = t, nbytes + t.numel() * t.element_size()
    engine.update_weights(sd, version)
    return nbytes
