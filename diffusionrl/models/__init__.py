"""Model-family adapters. ``load_adapter(cfg.model)`` picks the family of a reference."""

from __future__ import annotations

from .sd3 import SD3Adapter, hf_token, load_sd3_pipeline, module_digest, resolve_device
from .tiny import TINY_REF, build_tiny_sd3_pipeline, save_tiny_sd3
from .tiny_shapes import SHAPES_REF, build_shapes_pipeline, save_shapes_sd3


def load_adapter(model_cfg, mixed_precision: str = "no") -> SD3Adapter:
    """The adapter for a model reference (SD3/SD3.5 is the family supported today)."""
    return SD3Adapter.from_config(model_cfg, mixed_precision=mixed_precision)


__all__ = [
    "SD3Adapter",
    "SHAPES_REF",
    "TINY_REF",
    "build_shapes_pipeline",
    "build_tiny_sd3_pipeline",
    "hf_token",
    "load_adapter",
    "load_sd3_pipeline",
    "module_digest",
    "resolve_device",
    "save_shapes_sd3",
    "save_tiny_sd3",
]
