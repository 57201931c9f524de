"""QTensor: an FP4-quantized tensor as packed codes plus its scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Format
from .packing import mantissa_bits


@dataclass(frozen=True)
class QTensor:
    """A tensor quantized to NVFP4 or MXFP4 along its last dimension.

    Attributes:
        codes: uint8 [..., K/2], two E2M1 codes per byte, even element in the low nibble.
        block_scales: NVFP4: float8_e4m3fn [..., K/16]; MXFP4: uint8 E8M0 bytes [..., K/32].
        global_scale: NVFP4 only, float32, decode direction (value = code * block * global):
            a 0-d tensor for one scale per tensor, [..., 1] for one scale per row.
            None for MXFP4.
        fmt: the format.
        shape: the logical (unquantized) shape [..., K].
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor | None
    fmt: Format
    shape: torch.Size

    def __post_init__(self) -> None:
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        bs = self.fmt.block_size
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != lead + (k // 2,):
            raise ValueError(
                f"QTensor codes must be uint8 {lead + (k // 2,)}, got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        want = torch.float8_e4m3fn if self.fmt is Format.NVFP4 else torch.uint8
        if self.block_scales.dtype != want or tuple(self.block_scales.shape) != lead + (k // bs,):
            raise ValueError(
                f"QTensor {self.fmt.value} block_scales must be {want} {lead + (k // bs,)}, "
                f"got {self.block_scales.dtype} {tuple(self.block_scales.shape)}"
            )
        if self.fmt is Format.MXFP4:
            if self.global_scale is not None:
                raise ValueError("QTensor mxfp4 has no global scale; got one")
        else:
            g = self.global_scale
            if g is None or g.dtype != torch.float32 or tuple(g.shape) not in ((), lead + (1,)):
                raise ValueError(
                    f"QTensor nvfp4 global_scale must be float32 of shape () or {lead + (1,)}, "
                    f"got {None if g is None else (g.dtype, tuple(g.shape))}"
                )

    @property
    def block_size(self) -> int:
        return self.fmt.block_size

    @property
    def is_row_scaled(self) -> bool:
        """True when the global scale is per row rather than per tensor."""
        return self.global_scale is not None and self.global_scale.dim() > 0

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, block scales and global scales."""
        n = self.codes.numel() + self.block_scales.numel()
        return n + (4 * self.global_scale.numel() if self.global_scale is not None else 0)

    def to(self, device: torch.device | str) -> QTensor:
        g = None if self.global_scale is None else self.global_scale.to(device)
        return QTensor(self.codes.to(device), self.block_scales.to(device), g, self.fmt, self.shape)

    def rows(self) -> QTensor:
        """The same data viewed as 2-D rows: codes [M, K/2], scales [M, B], global [M, 1] or ()."""
        k = self.shape[-1]
        g = self.global_scale
        if g is not None and g.dim():
            g = g.reshape(-1, 1)
        return QTensor(
            self.codes.reshape(-1, k // 2),
            self.block_scales.reshape(-1, k // self.block_size),
            g,
            self.fmt,
            torch.Size((self.codes.numel() * 2 // k if k else 0, k)),
        )

    def rounding(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """How row-scaled NVFP4 rows rounded, what a dense guidance record keeps: (mantissa bits
        uint8 [M, K/8], block scale bytes uint8 [M, K/16], global scales float32 [M]), M the rows
        of `rows()`. No host synchronisation (a CUDA graph may capture it)."""
        if self.fmt is not Format.NVFP4 or not self.is_row_scaled:
            raise ValueError(f"QTensor.rounding needs row-scaled NVFP4, got {self.fmt.value} "
                             f"{'row' if self.is_row_scaled else 'tensor'}-scaled")
        r = self.rows()
        return mantissa_bits(r.codes), r.block_scales.view(torch.uint8), r.global_scale.reshape(-1)
