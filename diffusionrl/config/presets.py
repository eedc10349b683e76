"""Named configurations of the image ``Config`` (``tiny-cpu``, ``sd35m-ocr``, ...): ``PRESETS``.

A preset is a sequence of change sets: partial config dicts that ``diffusionrl.config.get_preset``
lays, in order, over the schema's defaults (``Config.merge_dicts``: sections key by key, leaves
replaced whole, unknown keys rejected). Presets built on presets list their parent's change sets
first. ``configs/<preset>.yaml`` holds each preset's full dump (``python -m diffusionrl.config
--preset NAME``); ``tests/test_config_files.py`` checks that they agree.

The change sets live by what they are for:

- ``presets_tiny``: the tiny CPU presets, every ``tiny-cpu*`` one, laid over ``TINY_CPU`` (CI runs them);
- ``presets_gpu``: the GPU recipes, whole recipes over the schema's defaults; the 8-GPU ones share their
  layout, ``EIGHT_GPU_COLOCATED``.

These modules hold data only: they import no schema, so ``diffusionrl.config`` can import them.
"""

from __future__ import annotations

from typing import Any

from .presets_gpu import GPU_PRESETS
from .presets_tiny import TINY_CPU_PRESETS, TINY_CPU_SHAPES  # TINY_CPU_SHAPES: bench/geneval_mini.py
from .tree import lookup_preset

__all__ = ["PRESETS", "TINY_CPU_SHAPES", "preset_changes"]

# Preset name -> its change sets, laid over the schema's defaults in this order: the tiny ones, then the GPU ones.
PRESETS: dict[str, tuple[dict[str, Any], ...]] = {**TINY_CPU_PRESETS, **GPU_PRESETS}


def preset_changes(name: str) -> tuple[dict[str, Any], ...]:
    """The change sets of preset ``name``; an unknown name is a ``ConfigError`` with a suggestion."""
    return lookup_preset(PRESETS, name)
