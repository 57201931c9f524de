"""Weight sync (docs/design.md section 5, step 1): the trainer's weights to the engines, in
buckets of at most `dist.sync_bucket_mb` MiB, FP4 sites packed for an FP4 engine. What each
trainer rank sends is its backend's (`Trainer.weight_buckets`): the Megatron trainer's ranks each
their shard (`megatron.sync`), the DeepSpeed trainer's rank 0 the whole model gathered a layer at
a time (`deepspeed.weights`)."""

from __future__ import annotations

from ..config import DistSection
from ..modes import EnginePrecision


def sync_weights(trainer, engine, version: int, bucket_mb: float = DistSection.sync_bucket_mb) -> int:
    """Send the trainer's weights (an `rl.trainer.Trainer`) to the engine (a RolloutBackend) as
    `version`: FP4 sites packed (codes + scales) when the engine runs FP4, BF16 otherwise, in
    buckets of at most `bucket_mb` MiB. Call on every trainer rank. Returns the bytes this rank
    sent (headers included; the sync's total is the sum over the trainer ranks)."""
    fp4 = EnginePrecision(engine.precision) is EnginePrecision.FP4
    buckets = trainer.weight_buckets(fp4, int(bucket_mb * 2**20))
    engine.update_weights_from_buckets(buckets, version)
    return buckets.nbytes
