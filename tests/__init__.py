"""diffusionrl tests (a package so helpers in conftest are importable)."""
