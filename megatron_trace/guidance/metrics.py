"""Flip rates (docs/design.md 4.5) and the calibration of the sparse margin tau."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from trace_kernels.fp4 import QTensor, unpack_codes
from trace_kernels.fp4.reference import nvfp4_scaled_values, round_scaled_to_e2m1

from .capture import boundary_distance_ulps


def code_flips(engine_codes: torch.Tensor, trainer_codes: torch.Tensor) -> torch.Tensor:
    """Elements whose codes differ in value (+0 and -0 are the same value). bool, same shape.

    Both arguments are unpacked uint8 codes of the same shape.
    """
    e = torch.where(engine_codes == 8, 0, engine_codes)
    t = torch.where(trainer_codes == 8, 0, trainer_codes)
    return e != t


@dataclass
class FlipStats:
    """Accumulates flips before and after guidance per (layer, site)."""

    elements: dict = field(default_factory=lambda: defaultdict(int))
    flips: dict = field(default_factory=lambda: defaultdict(int))
    residual: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, layer: int, site: str, engine: QTensor, trainer_rne: QTensor, trainer_guided: QTensor | None) -> None:
        key = (layer, site)
        e = unpack_codes(engine.codes)
        self.elements[key] += e.numel()
        self.flips[key] += int(code_flips(e, unpack_codes(trainer_rne.codes)).sum())
        after = trainer_guided if trainer_guided is not None else trainer_rne
        self.residual[key] += int(code_flips(e, unpack_codes(after.codes)).sum())

    def rates(self) -> dict[tuple[int, str], dict[str, float]]:
        """{(layer, site): {"flip_rate": ..., "residual_flip_rate": ...}}"""
        return {k: {"flip_rate": self.flips[k] / n, "residual_flip_rate": self.residual[k] / n}
                for k, n in self.elements.items() if n}

    def by_layer(self) -> dict[int, float]:
        """Flip rate per layer over all its sites (what the budget policy ranks by)."""
        num, den = defaultdict(int), defaultdict(int)
        for (layer, _), n in self.elements.items():
            num[layer] += self.flips[(layer, _)]
            den[layer] += n
        return {layer: num[layer] / den[layer] for layer in den if den[layer]}


def calibrate_tau(x_engine: torch.Tensor, x_trainer: torch.Tensor, q_engine: QTensor,
                  target_escape_rate: float = 1e-4, candidates=None) -> dict[str, float]:
    """Pick the sparse margin tau from a measured engine/trainer drift.

    Under the engine's scales, an element flips when the trainer's RNE code differs from the
    engine's; sparse coding catches it only if the engine shipped it (distance to a boundary
    below tau). Returns the smallest candidate tau whose escaped flips (flips not shipped) are
    at most `target_escape_rate` of all elements, with the kept share and flip rate it implies.

    Args:
        x_engine, x_trainer: the two sides' rows [R, K] for the same tokens.
        q_engine: the engine's row-scaled NVFP4 QTensor of x_engine.
    """
    candidates = candidates or [0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]
    g, s = q_engine.global_scale, q_engine.block_scales
    v_e = nvfp4_scaled_values(x_engine, g, s)
    flips = code_flips(unpack_codes(q_engine.codes), round_scaled_to_e2m1(nvfp4_scaled_values(x_trainer, g, s)))
    dist = boundary_distance_ulps(v_e)
    n = flips.numel()
    for tau in candidates:
        kept = dist < tau
        escaped = (flips & ~kept).sum().item() / n
        if escaped <= target_escape_rate:
            return {"tau": float(tau), "kept_rate": kept.float().mean().item(),
                    "flip_rate": flips.float().mean().item(), "escape_rate": escaped}
    raise ValueError(f"no tau up to {candidates[-1]} BF16 ulps keeps escaped flips under {target_escape_rate}: "
                     "the drift is not ulp-level; guide densely or find its source")
