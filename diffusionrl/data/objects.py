"""``builtin:objects``: a small generator of object/scene prompts (the tiny-model default)."""

from __future__ import annotations

from typing import Any

import numpy as np

_COLORS = "red green blue yellow orange purple pink black white brown golden silver".split()
_ADJ = "small large old new bright dark shiny wooden metal glass stone tiny".split()
_OBJECTS = (
    "cat dog bird fish horse car bus bike boat tree flower house apple banana cake cup bottle "
    "book chair table lamp clock robot castle bridge hat shoe ball"
).split()
_PLACES = (
    "on the beach|in the forest|in a city street|on a mountain|by the river|on a table|in the snow|"
    "at night|in the garden|in a desert|under a cloudy sky|in the morning"
).split("|")


def generate_object_prompts(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    """Distinct "a <adj> <color> <object> <place>" prompts, deterministic by seed."""
    rng = np.random.default_rng(seed)
    seen: dict[str, None] = {}
    capacity = len(_COLORS) * len(_ADJ) * len(_OBJECTS) * len(_PLACES)
    if num_prompts > capacity:
        raise ValueError(f"builtin:objects can make at most {capacity} distinct prompts, asked for {num_prompts}")
    while len(seen) < num_prompts:
        p = (
            f"a {_ADJ[rng.integers(len(_ADJ))]} {_COLORS[rng.integers(len(_COLORS))]} "
            f"{_OBJECTS[rng.integers(len(_OBJECTS))]} {_PLACES[rng.integers(len(_PLACES))]}"
        )
        seen.setdefault(p, None)
    return [{"prompt": p} for p in seen]
