"""The quantizer roles of a TE `CustomRecipe` factory, read into what TRACE's recipe does.

TE calls the factory once per quantizer slot of a module. TE 2.9-2.15 pass a string:
forward slots cycle "linear_input", "linear_weight", "linear_output", backward slots
"linear_grad_output", "linear_grad_input" (`GroupedLinear` gets the same strings, one triple or
pair per GEMM), anything else "unknown". TE 2.16+ pass a `QuantizerRole` (module_type "linear",
"grouped_linear" or "dpa"; tensor_type "input", "weight", "grad_output", ...; the module's name),
or None for an output / grad-input slot no role was asked for.

TRACE's recipe (docs/design.md sections 2-3): weights in NVFP4 round-to-nearest with one global
scale over the whole logical tensor, GEMM inputs in NVFP4 rows (guided where the engine's
guidance covers them), everything else (outputs, gradients, attention's own slots) in high
precision with the straight-through estimator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Slot(enum.Enum):
    INPUT = "input"
    WEIGHT = "weight"
    OUTPUT = "output"
    GRAD_OUTPUT = "grad_output"
    GRAD_INPUT = "grad_input"


class Treatment(enum.Enum):
    FP4_WEIGHT = "fp4-weight"  # NVFP4 RNE, one global scale over the logical tensor
    FP4_INPUT = "fp4-input"  # NVFP4 rows, one global scale per row; guided where guidance covers them
    HIGH_PRECISION = "high-precision"  # TE's IdentityQuantizer


GEMM_MODULES = ("linear", "grouped_linear")  # the module types whose GEMM inputs TRACE quantizes
OTHER_MODULES = ("dpa",)  # dot-product attention: TRACE quantizes K/V at its own site, not through TE


@dataclass(frozen=True)
class Role:
    """One quantizer slot. module: "linear", "grouped_linear", "dpa", or "" when TE did not say
    (its 2.9-2.15 strings do not tell Linear from GroupedLinear); slot: None for a slot outside
    the GEMMs' (TE's "unknown", attention's tensors); name: the module's name ("" unless set)."""

    module: str
    slot: Slot | None
    name: str = ""


def parse_role(role) -> Role | None:
    """A TE role (str for TE 2.9-2.15, `QuantizerRole` for 2.16+, None for an unused slot) as a
    `Role`; None stays None. Anything else is a TypeError, an unknown GEMM slot a ValueError."""
    if role is None:
        return None
    if isinstance(role, str):
        if role == "unknown":
            return Role("", None)
        module, sep, tensor = role.partition("_")
        if module != "linear" or not sep:
            raise ValueError(f"TE quantizer role {role!r}: TRACE's recipe knows 'linear_<slot>' and 'unknown'")
        return Role("", _slot(tensor, role))
    if hasattr(role, "module_type") and hasattr(role, "tensor_type"):
        module, tensor, name = role.module_type, role.tensor_type, getattr(role, "name", "") or ""
        if module in OTHER_MODULES:
            return Role(module, None, name)
        if module not in GEMM_MODULES:
            raise ValueError(f"TE quantizer role {role!r}: module_type {module!r} is not one of "
                             f"{GEMM_MODULES + OTHER_MODULES}")
        return Role(module, _slot(tensor, role), name)
    raise TypeError(f"TE quantizer role {role!r} ({type(role).__name__}): expected a str (TE 2.9-2.15), "
                    "a QuantizerRole (TE 2.16+) or None")


def _slot(tensor: str, role) -> Slot:
    try:
        return Slot(tensor)
    except ValueError:
        raise ValueError(f"TE quantizer role {role!r}: tensor {tensor!r} is not one of "
                         f"{[s.value for s in Slot]}") from None


def treatment(role: Role | None) -> Treatment:
    """What TRACE's recipe does with a slot: weights and GEMM inputs in FP4, the rest in high
    precision (outputs, both gradients, attention's slots, TE's unused and unknown slots)."""
    if role is None or role.slot is None:
        return Treatment.HIGH_PRECISION
    if role.slot is Slot.WEIGHT:
        return Treatment.FP4_WEIGHT
    if role.slot is Slot.INPUT:
        return Treatment.FP4_INPUT
    return Treatment.HIGH_PRECISION
