"""One guidance record: what the engine tells the trainer about one (sample, layer, site).

Payload by coding (R rows of K elements, row-scaled NVFP4):
    dense:  g float32 [R], scales uint8 [R, K/16] (E4M3 bits), bits uint8 [R, K/8]
            -> 32 R + 8 R K/16 + R K bits: 1.5 bits per element plus one FP32 per row.
    sparse: g float32 [R]; elem_pos (gap stream) + elem_bits uint8 [ceil(n_elems / 8)] for the
            elements near an E2M1 rounding boundary; and the block scales either as
            scale_coding "lsb": scale_bits uint8 [ceil(R K/16 / 8)], every scale's last code bit
                (1/16 bit per element; the trainer rounds its own scale to the matching
                neighbour, exact under any drift below half an E4M3 step, >= 3% relative), or
            scale_coding "near": scale_pos (gap stream) + scale_val uint8 [n_scales], only the
                scales near an E4M3 rounding boundary.
The header names what the record belongs to; `check_fits` refuses to apply it elsewhere.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from .codec import GuidanceFormatError

FORMAT_VERSION = 1
# the FP4 sites whose input rows guidance covers (docs/design.md sections 3 and 3.1): q_up, kv and
# shared_fc2 exist in the DeepSeek-V3 family only
SITES = ("qkv", "proj", "fc1", "fc2", "k", "v", "q_up", "kv", "shared_fc2")


class Coding(str, enum.Enum):
    DENSE = "dense"
    SPARSE = "sparse"


SCALE_CODINGS = ("lsb", "near")


def payload_keys(coding: Coding, scale_coding: str | None) -> tuple[str, ...]:
    """Payload tensors of a record, in wire order."""
    if coding is Coding.DENSE:
        return ("g", "scales", "bits")
    scales = ("scale_bits",) if scale_coding == "lsb" else ("scale_pos", "scale_val")
    return ("g", *scales, "elem_pos", "elem_bits")


@dataclass(frozen=True, kw_only=True)
class RecordHeader:
    """What a record belongs to. Every field is checked before the record is applied."""

    model_id: str
    layer: int
    site: str
    rows: int
    cols: int
    sample_id: str
    weight_version: int
    policy: str
    coding: Coding
    tau: float | None = None  # sparse element margin, in BF16 ulps of the element's magnitude
    scale_tau: float | None = None  # sparse "near" block-scale margin, in BF16 ulps of the scale
    scale_coding: str | None = None  # sparse: "lsb" or "near"
    n_scales: int = 0  # sparse: block scales shipped
    n_elems: int = 0  # sparse: elements shipped
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise GuidanceFormatError(f"unknown FP4 site {self.site!r}; sites are {SITES}")
        if self.coding is Coding.SPARSE and self.scale_coding not in SCALE_CODINGS:
            raise GuidanceFormatError(f"unknown sparse scale coding {self.scale_coding!r}; use one of {SCALE_CODINGS}")
        if self.cols % 16 or self.cols <= 0 or self.rows < 0:
            raise GuidanceFormatError(f"record shape {self.rows}x{self.cols}: "
                                      "columns must be a positive multiple of 16")

    def to_dict(self) -> dict:
        """The header as JSON-ready values."""
        d = dataclasses.asdict(self)
        d["coding"] = self.coding.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RecordHeader:
        """The header `to_dict` wrote; GuidanceFormatError for another format version or a bad field."""
        if d.get("format_version") != FORMAT_VERSION:
            raise GuidanceFormatError(
                f"guidance format version {d.get('format_version')!r} is not supported "
                f"(this build reads {FORMAT_VERSION})")
        try:
            coding = Coding(d["coding"])
        except ValueError:
            raise GuidanceFormatError(f"unknown guidance coding {d['coding']!r}") from None
        return cls(**{**d, "coding": coding})


@dataclass(frozen=True)
class GuidanceRecord:
    header: RecordHeader
    payload: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        want = payload_keys(self.header.coding, self.header.scale_coding)
        if tuple(sorted(self.payload)) != tuple(sorted(want)):
            raise GuidanceFormatError(f"{self.header.coding.value} payload needs keys {want}, "
                                      f"got {tuple(self.payload)}")
        r, k = self.header.rows, self.header.cols
        shapes = {"g": (torch.float32, (r,))}
        if self.header.coding is Coding.DENSE:
            shapes |= {"scales": (torch.uint8, (r, k // 16)), "bits": (torch.uint8, (r, k // 8))}
        else:
            shapes |= {"elem_bits": (torch.uint8, ((self.header.n_elems + 7) // 8,))}
            if self.header.scale_coding == "lsb":
                shapes |= {"scale_bits": (torch.uint8, ((r * k // 16 + 7) // 8,))}
            else:
                shapes |= {"scale_val": (torch.uint8, (self.header.n_scales,))}
        for key in ("elem_pos", "scale_pos"):  # gap streams: flat bytes of any length (checked when decoded)
            if key in self.payload:
                shapes[key] = (torch.uint8, (self.payload[key].numel(),))
        for key, (dtype, shape) in shapes.items():
            t = self.payload[key]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise GuidanceFormatError(
                    f"record layer {self.header.layer} site {self.header.site}: payload {key!r} must be "
                    f"{dtype} {shape}, got {t.dtype} {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        """Payload bytes (the header is a few hundred bytes per record, counted separately)."""
        return sum(t.numel() * t.element_size() for t in self.payload.values())

    @property
    def bits_per_element(self) -> float:
        """The record's size per guided element, in bits."""
        n = self.header.rows * self.header.cols
        return 8 * self.nbytes / n if n else 0.0

    def check_fits(self, *, rows: int, cols: int, sample_id: str | None = None,
                   weight_version: int | None = None, layer: int | None = None, site: str | None = None) -> None:
        """Raise GuidanceFormatError naming the first field in which this record and its use disagree."""
        h = self.header
        wanted = {"rows": rows, "cols": cols, "sample_id": sample_id, "weight_version": weight_version,
                  "layer": layer, "site": site}
        for name, value in wanted.items():
            if value is not None and getattr(h, name) != value:
                raise GuidanceFormatError(
                    f"guidance record for layer {h.layer} site {h.site} sample {h.sample_id!r} does not fit: "
                    f"{name} is {getattr(h, name)!r} in the record but {value!r} where it is applied")
