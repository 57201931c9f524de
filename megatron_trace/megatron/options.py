"""Megatron-core's own TransformerConfig settings that a run passes through (`trainer.megatron`):
checked against TransformerConfig's fields, and refused where TRACE sets the field itself."""

from __future__ import annotations

import dataclasses


def check_megatron_options(options: dict, key: str = "trainer.megatron") -> None:
    """ValueError naming the keys of `options` that are not fields of Megatron's TransformerConfig
    (MLATransformerConfig's included)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(MLATransformerConfig)})
    if unknown:
        raise ValueError(f"config: {key} has keys that are not Megatron TransformerConfig fields: {unknown}")


def with_megatron_options(settings: dict, options: dict, key: str = "trainer.megatron") -> dict:
    """TRACE's TransformerConfig `settings` plus the user's `options`; ValueError naming any
    option that TRACE sets itself (from the model, dist and trainer sections) or that is not a field."""
    owned = sorted(set(options) & set(settings))
    if owned:
        raise ValueError(f"config: {key} sets {owned}, which TRACE sets from the model, dist and trainer "
                         "sections (set those instead)")
    check_megatron_options(options, key)
    return {**settings, **options}
