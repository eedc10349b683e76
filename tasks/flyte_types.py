"""One Flyte literal type per config class, computed once per process.

flytekit's ``DataclassTransformer.get_literal_type`` builds a dataclass's JSON schema (mashumaro)
and its fields' literal types every time an interface names the class: for the image ``Config`` a
noticeable cost, paid at import for every task that takes a ``Config`` (or a section) and again for
every workflow node when a workflow is compiled (its first local call), many times per ``pyflyte
run``. The type of a class does not change within a process, so the first answer is kept for the
config trees (``diffusionrl.config.tree.ConfigTree`` subclasses and their section
dataclasses, whose modules are ``diffusionrl.*``); every other dataclass goes through flytekit as
before. Imported by ``tasks/__init__.py``, before any task is declared.
"""

from __future__ import annotations

import dataclasses
import functools

from flytekit.core.type_engine import DataclassTransformer

_original = DataclassTransformer.get_literal_type
_cache: dict[type, object] = {}


def _ours(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t) and t.__module__.startswith("diffusionrl.")


@functools.wraps(_original)
def _cached_literal_type(self, t):
    if not _ours(t):
        return _original(self, t)
    if t not in _cache:
        _cache[t] = _original(self, t)
    return _cache[t]


if getattr(DataclassTransformer.get_literal_type, "__wrapped__", None) is not _original:
    DataclassTransformer.get_literal_type = _cached_literal_type
