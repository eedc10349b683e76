"""Flyte tasks: thin wrappers that unpack typed inputs, call ``diffusionrl`` and pack outputs."""

from . import flyte_types  # noqa: F401  (config literal types computed once per process)
