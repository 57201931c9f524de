"""TRACE guidance (docs/design.md section 4): capture on the engine, reconstruction on the trainer,
the compact cache's record and batch formats, layer policies and flip-rate metrics."""

from .batch import GroupGuidance, GuidanceBatch, SampleGuidance, expert_id_dtype
from .capture import (
    DEFAULT_SCALE_TAU,
    DEFAULT_TAU,
    capture,
    capture_dense,
    capture_sparse,
    capture_sparse_sites,
    guided_inputs,
    sparse_parts,
    sparse_parts_of_dense,
)
from .codec import GuidanceFormatError, decode_position_streams, decode_positions, encode_positions
from .metrics import FlipStats, calibrate_tau, code_flips
from .policy import LayerPolicy
from .record import FORMAT_VERSION, SITES, Coding, GuidanceRecord, RecordHeader

__all__ = [
    "DEFAULT_SCALE_TAU", "DEFAULT_TAU", "FORMAT_VERSION", "SITES", "Coding", "FlipStats", "GroupGuidance",
    "GuidanceBatch", "GuidanceFormatError", "GuidanceRecord", "LayerPolicy", "RecordHeader", "SampleGuidance",
    "calibrate_tau", "capture", "capture_dense", "capture_sparse", "capture_sparse_sites", "code_flips",
    "decode_position_streams", "decode_positions", "encode_positions", "expert_id_dtype", "guided_inputs",
    "sparse_parts", "sparse_parts_of_dense",
]
