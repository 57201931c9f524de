"""Capture (engine side) and reconstruction (trainer side) of one site's guidance.

The engine quantizes a site's input rows with per-row NVFP4 scales; `capture` turns its
pre-quantization rows and their QTensor into a record (docs/design.md 4.1, 4.4). The trainer's
`guided_inputs` turns a record plus its own rows back into the (g, block scales, mantissa
bits) that `trace_kernels.fp4.quantize_guided` takes. For sparse records the trainer
recomputes what was not shipped: block scales from its own block amax under the engine's g,
and mantissa bits from its own round-to-nearest codes under those scales.
"""

from __future__ import annotations

import numpy as np
import torch

from trace_kernels.fp4 import QTensor, mantissa_bits, pack_bits
from trace_kernels.fp4.formats import E2M1_ROUNDING_BOUNDARIES
from trace_kernels.fp4.reference import (
    nvfp4_block_amax,
    nvfp4_block_scale_unrounded,
    nvfp4_block_scales,
    nvfp4_scaled_values,
)

from .codec import GuidanceFormatError, encode_position_lists, pack_bits_at
from .record import Coding, GuidanceRecord, RecordHeader
from .rows import RowGuidance

BF16_ULP = 2.0**-8  # relative spacing of bfloat16 values (8 significant bits)
DEFAULT_TAU = 2.0  # element margin in BF16 ulps of the element's magnitude (docs/notes/guidance-calibration.md)
DEFAULT_SCALE_TAU = 1.0  # block-scale margin in BF16 ulps of the pre-rounding scale (bench/guidance_bytes.py)
MAGNITUDE_FLOOR = 0.25  # margins of tiny elements are measured against this magnitude


def boundary_distance_ulps(v: torch.Tensor) -> torch.Tensor:
    """Distance of scaled values to the nearest E2M1 rounding boundary, in BF16 ulps of |v|
    (magnitudes below 0.25 count as 0.25). float32, same shape."""
    a = v.abs()
    # boundaries as Python scalars: a constant tensor would be a pageable host-to-device copy,
    # which CUDA graph capture (SGLang's decode graphs record guidance) refuses
    first, *rest = E2M1_ROUNDING_BOUNDARIES
    dist = (a - first).abs()
    for bound in rest:
        dist = torch.minimum(dist, (a - bound).abs())
    return dist / (BF16_ULP * a.clamp(min=MAGNITUDE_FLOOR))


def scale_margin_mask(block_amax_RB: torch.Tensor, g_R1: torch.Tensor, tau: float) -> torch.Tensor:
    """Block scales whose pre-rounding value lies within tau BF16 ulps of an E4M3 rounding
    boundary (or whose block is all zero, where any drift changes the scale). bool [R, B]."""
    r = nvfp4_block_scale_unrounded(block_amax_RB, g_R1)
    s = nvfp4_block_scales(block_amax_RB, g_R1)
    b = s.view(torch.uint8).to(torch.int32)
    up = (b + 1).clamp(max=0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()
    down = (b - 1).clamp(min=0).to(torch.uint8).view(torch.float8_e4m3fn).float()
    sf = s.float()
    dist = torch.minimum((r - (sf + up) / 2).abs(), (r - (sf + down) / 2).abs())
    return (dist < tau * BF16_ULP * r) | (block_amax_RB == 0)


def capture(
    x_RK: torch.Tensor,
    q: QTensor,
    *,
    model_id: str,
    layer: int,
    site: str,
    sample_id: str,
    weight_version: int,
    policy: str,
    coding: Coding | str = Coding.DENSE,
    tau: float = DEFAULT_TAU,
    scale_coding: str = "lsb",
    scale_tau: float = DEFAULT_SCALE_TAU,
) -> GuidanceRecord:
    """Build a site's guidance record from the engine's rows and their quantization.

    Args:
        x_RK: the engine's pre-quantization rows [R, K] (any float dtype).
        q: their row-scaled NVFP4 QTensor (`quantize(x_RK, scale="row")`).
        coding: "dense" (every mantissa bit and block scale) or "sparse" (g always; the
            elements within `tau` BF16 ulps of a rounding boundary; block scales by
            `scale_coding`: "lsb", every scale's last bit, or "near", those within
            `scale_tau` BF16 ulps of an E4M3 rounding boundary). See record.py.
    Returns:
        GuidanceRecord with CPU payload tensors.
    """
    coding = Coding(coding)
    if q.fmt.value != "nvfp4" or not q.is_row_scaled or tuple(q.shape) != tuple(x_RK.shape) or x_RK.dim() != 2:
        raise GuidanceFormatError("capture needs 2-D rows and their row-scaled NVFP4 QTensor of the same shape")
    g_R1 = q.global_scale
    if coding is Coding.DENSE:
        return capture_dense(mantissa_bits(q.codes), q.block_scales.view(torch.uint8), g_R1.reshape(-1),
                             model_id=model_id, layer=layer, site=site, sample_id=sample_id,
                             weight_version=weight_version, policy=policy)
    header = dict(model_id=model_id, layer=layer, site=site, sample_id=sample_id, weight_version=weight_version,
                  policy=policy)
    return capture_sparse(*sparse_parts(x_RK, q, tau, scale_coding, scale_tau), **header, tau=tau,
                          scale_coding=scale_coding, scale_tau=scale_tau)


def sparse_parts(
    x_RK: torch.Tensor,
    q: QTensor,
    tau: float = DEFAULT_TAU,
    scale_coding: str = "lsb",
    scale_tau: float = DEFAULT_SCALE_TAU,
) -> tuple[torch.Tensor, ...]:
    """What a sparse record keeps about rows x_RK and their row-scaled NVFP4 QTensor q, as
    row-aligned tensors on x's device: the engine computes them for a whole step's rows on the
    GPU and slices them per sequence (quantizing each sequence's host rows again cost most of a
    sparse RL step's host time).

    Returns:
        (mantissa bits uint8 [R, K/8] (element i in bit i % 8 of byte i // 8), block scale bytes
         uint8 [R, K/16], g float32 [R], near-boundary elements uint8 [R, K/8] packed alike
         (within `tau` BF16 ulps of an E2M1 rounding boundary)), and with scale_coding "near" a
        fifth part: uint8 [R, K/16], 1 for the block scales within `scale_tau` ulps (or of an
        all-zero block). `capture_sparse` turns a slice of them into the record.
    """
    if q.fmt.value != "nvfp4" or not q.is_row_scaled or tuple(q.shape) != tuple(x_RK.shape) or x_RK.dim() != 2:
        raise GuidanceFormatError("sparse_parts needs 2-D rows and their row-scaled NVFP4 QTensor of the same shape")
    return sparse_parts_of_dense(x_RK, mantissa_bits(q.codes), q.block_scales.view(torch.uint8), q.global_scale,
                                 tau, scale_coding, scale_tau)


def sparse_parts_of_dense(
    x_RK: torch.Tensor,
    bits_RK8: torch.Tensor,
    scales_RB: torch.Tensor,
    g_R: torch.Tensor,
    tau: float = DEFAULT_TAU,
    scale_coding: str = "lsb",
    scale_tau: float = DEFAULT_SCALE_TAU,
) -> tuple[torch.Tensor, ...]:
    """`sparse_parts` of rows x_RK [R, K] from what a dense record keeps of their rounding
    (mantissa bits uint8 [R, K/8], block scale bytes uint8 [R, K/16], global scales g [R]), e.g.
    a fused quantize kernel's capture, or a tensor-parallel rank's column slice of the rows
    (the row's g, this slice's blocks)."""
    if scale_coding not in ("lsb", "near"):
        raise GuidanceFormatError(f"scale_coding must be 'lsb' or 'near', got {scale_coding!r}")
    g_R1, scales = g_R.reshape(-1, 1).float(), scales_RB.view(torch.float8_e4m3fn)
    # in row chunks: the scaled values and their boundary distances are [rows, K] float32 temporaries
    n = max(1, (1 << 22) // x_RK.shape[1])
    near = x_RK.new_zeros(x_RK.shape, dtype=torch.bool)
    for i in range(0, x_RK.shape[0], n):
        v = nvfp4_scaled_values(x_RK[i:i + n], g_R1[i:i + n], scales[i:i + n])
        near[i:i + n] = boundary_distance_ulps(v) < tau
    parts = (bits_RK8, scales_RB.view(torch.uint8), g_R1.reshape(-1), pack_bits(near))  # bools: no host sync
    if scale_coding == "near":
        parts += (scale_margin_mask(nvfp4_block_amax(x_RK), g_R1, scale_tau).to(torch.uint8),)
    return parts


def capture_sparse(
    bits_RK8: torch.Tensor,
    scales_RB: torch.Tensor,
    g_R: torch.Tensor,
    near_RK8: torch.Tensor,
    scale_near_RB: torch.Tensor | None = None,
    *,
    layer: int,
    site: str,
    **header,
) -> GuidanceRecord:
    """A sparse guidance record from (a row slice of) `sparse_parts`: g always, the mantissa
    bits of the near-boundary elements with their positions, block scales by `scale_coding`
    ("lsb": every scale's last bit; "near": the marked scales with their positions).
    Payload tensors on the CPU. `header`: `capture_sparse_sites`' keyword arguments."""
    parts = (bits_RK8, scales_RB, g_R, near_RK8) + (() if scale_near_RB is None else (scale_near_RB,))
    return capture_sparse_sites({(layer, site): parts}, **header)[(layer, site)]


def capture_sparse_sites(
    parts: dict[tuple[int, str], tuple[torch.Tensor, ...]],
    *,
    model_id: str,
    sample_id: str,
    weight_version: int,
    policy: str,
    tau: float = DEFAULT_TAU,
    scale_coding: str = "lsb",
    scale_tau: float = DEFAULT_SCALE_TAU,
) -> dict[tuple[int, str], GuidanceRecord]:
    """`capture_sparse` of one owner's (layer, site)s at once: {(layer, site): (a row slice of)
    `sparse_parts`} -> {(layer, site): record}. The sites' bytes are joined and their positions
    found, split and encoded in one pass: an engine makes ~10^4 sparse records a step, and numpy's
    per-call cost, paid per record, was most of a sparse rollout's host time."""
    keys = list(parts)
    if not keys:
        return {}
    for key in keys:
        if (scale_coding == "near") != (len(parts[key]) == 5):
            raise GuidanceFormatError(f"capture_sparse: scale_coding {scale_coding!r} "
                                      f"{'needs' if scale_coding == 'near' else 'takes no'} marked scales "
                                      f"(layer {key[0]} site {key[1]})")
        # the parts are joined as flat bytes: one site's parts that disagree would shift the others'
        shapes = [tuple(t.shape) for t in parts[key]]
        r, k8 = shapes[0] if len(shapes[0]) == 2 else (-1, 0)
        if r < 0 or shapes != [(r, k8), (r, k8 // 2), (r,), (r, k8)] + [(r, k8 // 2)] * (len(shapes) == 5):
            raise GuidanceFormatError(f"capture_sparse: layer {key[0]} site {key[1]}: parts of shapes {shapes}, "
                                      "want bits [R, K/8], scales [R, K/16], g [R], near [R, K/8] (and "
                                      "marked scales [R, K/16])")
    bits, scales, g, near = ([parts[k][i] for k in keys] for i in range(4))
    # on the host in numpy (torch's per-op overhead, and on a GPU a sync per nonzero, was most of
    # a sparse step's time); bit order as pack_bits' (element 8j+i in bit i of byte j)
    nbytes = np.array([b.numel() for b in bits], dtype=np.int64)
    byte_start = np.cumsum(nbytes) - nbytes
    near_all = _joined(near)
    # positions from the nonzero bytes only (a few percent of elements are near a boundary)
    near_bytes = np.flatnonzero(near_all)
    in_byte = np.unpackbits(near_all[near_bytes, None], axis=1, bitorder="little").astype(bool)
    elem = (near_bytes[:, None] * 8 + np.arange(8))[in_byte]  # increasing: bytes, then bits
    kept = (_joined(bits)[elem >> 3] >> (elem & 7)) & 1
    n_elems, elem_pos = _split_positions(elem, byte_start * 8)
    first = np.cumsum(n_elems) - n_elems
    # each site's kept bits packed from its own byte 0: kept bit k of site i at bit 8 * out_start[i] + k
    bits_nbytes = (n_elems + 7) // 8
    out_start = np.cumsum(bits_nbytes) - bits_nbytes
    at = np.arange(elem.size) + np.repeat(out_start * 8 - first, n_elems)
    elem_bits = _split(pack_bits_at(at, int(bits_nbytes.sum()), kept), bits_nbytes)
    scale_bytes = _joined(scales)
    nblocks = np.array([t.numel() for t in scales], dtype=np.int64)
    block_start = np.cumsum(nblocks) - nblocks
    if scale_coding == "lsb":
        set_at = np.flatnonzero(scale_bytes & 1)
        per, _ = _split_positions(set_at, block_start)
        lsb_nbytes = (nblocks + 7) // 8
        at = set_at + np.repeat((np.cumsum(lsb_nbytes) - lsb_nbytes) * 8 - block_start, per)
        scale_payload = [{"scale_bits": b} for b in _split(pack_bits_at(at, int(lsb_nbytes.sum())), lsb_nbytes)]
        n_scales = nblocks
    else:
        marked = np.flatnonzero(_joined([parts[k][4] for k in keys]))
        n_scales, scale_pos = _split_positions(marked, block_start)
        scale_payload = [{"scale_pos": p, "scale_val": v}
                         for p, v in zip(scale_pos, _split(scale_bytes[marked], n_scales), strict=True)]
    records = {}
    for i, (layer, site) in enumerate(keys):
        header = RecordHeader(model_id=model_id, layer=layer, site=site, rows=bits[i].shape[0],
                              cols=bits[i].shape[1] * 8, sample_id=str(sample_id), weight_version=weight_version,
                              policy=policy, coding=Coding.SPARSE, tau=tau, scale_coding=scale_coding,
                              scale_tau=scale_tau if scale_coding == "near" else None,
                              n_scales=int(n_scales[i]), n_elems=int(n_elems[i]))
        payload = {"g": g[i].reshape(-1).float().cpu(), "elem_pos": elem_pos[i], "elem_bits": elem_bits[i],
                   **scale_payload[i]}
        records[(layer, site)] = GuidanceRecord(header, payload)
    return records


def _joined(ts: list[torch.Tensor]) -> np.ndarray:
    """uint8 tensors' bytes, flat, one after another, as a numpy array on the host."""
    return torch.cat([t.detach().reshape(-1) for t in ts]).cpu().numpy()


def _split(a: np.ndarray, sizes: np.ndarray) -> list[torch.Tensor]:
    """A joined array cut into consecutive pieces of `sizes`, as tensors of their own (a view
    would keep, and a pickle would carry, the whole joined array)."""
    return [torch.from_numpy(x.copy()) for x in np.split(a, np.cumsum(sizes)[:-1])]


def _split_positions(pos: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Increasing positions in joined arrays whose parts start at `starts` -> (how many fall in
    each part int64 [P], each part's positions relative to its start as a gap stream)."""
    cut = np.searchsorted(pos, starts)
    counts = np.diff(np.append(cut, pos.size))
    streams, sizes = encode_position_lists(pos - np.repeat(starts, counts), counts)
    return counts, _split(streams, sizes)


def capture_dense(
    bits_RK8: torch.Tensor,
    scales_RB: torch.Tensor,
    g_R: torch.Tensor,
    *,
    model_id: str,
    layer: int,
    site: str,
    sample_id: str,
    weight_version: int,
    policy: str,
) -> GuidanceRecord:
    """A dense guidance record from what the engine's fused quantize kernel kept
    (trace_kernels.fp4.fake_quantize_rows(capture=True)): no second quantization of the rows.

    Args:
        bits_RK8: uint8 [R, K/8], each element's mantissa bit (element i in bit i % 8 of byte i // 8).
        scales_RB: uint8 [R, K/16], E4M3 block scale bytes. g_R: float32 [R], global scales.
    """
    if bits_RK8.dim() != 2:  # GuidanceRecord checks every payload's dtype and shape against the header
        raise GuidanceFormatError(f"capture_dense: bits must be [R, K/8], got shape {tuple(bits_RK8.shape)}")
    header = RecordHeader(model_id=model_id, layer=layer, site=site, rows=g_R.numel(), cols=bits_RK8.shape[1] * 8,
                          sample_id=str(sample_id), weight_version=weight_version, policy=policy, coding=Coding.DENSE)
    payload = {"g": g_R.reshape(-1).cpu(), "scales": scales_RB.cpu(), "bits": bits_RK8.cpu()}
    return GuidanceRecord(header, payload)


def guided_inputs(record: GuidanceRecord, x_RK: torch.Tensor,
                  **expected) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's arguments for `quantize_guided` from a record and its own rows.

    Args:
        record: the site's record.
        x_RK: the trainer's rows [R, K] for the same tokens (any float dtype, any device).
        expected: header fields the use must agree with (sample_id, weight_version, layer, site).
    Returns:
        (g float32 [R, 1], block scales float8_e4m3fn [R, K/16], mantissa bits uint8 [R, K/8]),
        on x's device.
    Raises:
        GuidanceFormatError: the record does not fit these rows or the expected fields.
    """
    rows, cols = x_RK.shape
    record.check_fits(rows=rows, cols=cols, **expected)
    return RowGuidance.from_record(record).resolve(x_RK)
