"""Flyte tasks: thin wrappers that unpack typed inputs, call ``diffusionrl`` and pack outputs."""
