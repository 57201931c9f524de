"""The one vocabulary of precisions: what the engine runs, what the trainer runs, and the RL
run modes that pair them (docs/design.md sections 1 and 3).

"fp4" names the number format only (NVFP4: E2M1 elements, E4M3 block scales, an FP32 global
scale). A run mode says where it applies:

    RunMode       engine (EnginePrecision)        trainer (TrainerPrecision)
    bf16          bf16                            bf16
    fp4-rollout   fp4: W4A4 + FP4 KV cache        bf16 (no QAT)
    fp4-qat       fp4                             fp4-rne: QAT, round to nearest even
    trace         fp4                             fp4-guided: QAT following the engine's guidance

Every mode replays the engine's routing (rollout routing replay).
"""

from __future__ import annotations

import enum


class _Choice(str, enum.Enum):
    """A str enum whose unknown values raise a ValueError naming the choices (and, for a name
    that meant something else before, what it is called now: `_renamed`)."""

    @classmethod
    def _missing_(cls, value):
        renamed = getattr(cls, "_renamed", lambda: {})()
        hint = f"; {value!r} is now {renamed[value]}" if value in renamed else ""
        raise ValueError(f"{value!r} is not a valid {cls.__name__}: choose one of {[m.value for m in cls]}{hint}")

    def __str__(self) -> str:
        return self.value


class EnginePrecision(_Choice):
    """What the rollout engine runs: BF16, or FP4 weights, activations and KV cache."""

    BF16 = "bf16"
    FP4 = "fp4"


class TrainerPrecision(_Choice):
    """What the trainer's FP4 sites run: BF16 (no fake quant), FP4 QAT rounding to nearest
    even, or FP4 QAT following the engine's guidance where the micro-batch carries it (round to
    nearest elsewhere)."""

    BF16 = "bf16"
    FP4_RNE = "fp4-rne"
    FP4_GUIDED = "fp4-guided"

    @property
    def quantizes(self) -> bool:
        """True when the FP4 sites fake-quantize (QAT)."""
        return self is not TrainerPrecision.BF16

    @staticmethod
    def _renamed() -> dict[str, str]:
        return {"fp4": "fp4-rne (QAT, round to nearest)", "trace": "fp4-guided (QAT following the guidance)"}


class RunMode(_Choice):
    """An RL run's pair of precisions (see the module docstring)."""

    BF16 = "bf16"
    FP4_ROLLOUT = "fp4-rollout"
    FP4_QAT = "fp4-qat"
    TRACE = "trace"

    @property
    def engine_precision(self) -> EnginePrecision:
        """What the rollout engine runs in this mode."""
        return EnginePrecision.BF16 if self is RunMode.BF16 else EnginePrecision.FP4

    @property
    def trainer_precision(self) -> TrainerPrecision:
        """What the trainer's FP4 sites run in this mode."""
        return {RunMode.BF16: TrainerPrecision.BF16, RunMode.FP4_ROLLOUT: TrainerPrecision.BF16,
                RunMode.FP4_QAT: TrainerPrecision.FP4_RNE, RunMode.TRACE: TrainerPrecision.FP4_GUIDED}[self]

    @property
    def applies_guidance(self) -> bool:
        """True when the trainer follows the engine's rounding (the records are applied)."""
        return self.trainer_precision is TrainerPrecision.FP4_GUIDED

    @staticmethod
    def _renamed() -> dict[str, str]:
        return {"fp4": "fp4-rollout (FP4 engine, BF16 trainer)"}
