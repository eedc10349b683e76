"""Predict per-rank peak GPU memory and step time of a config before launch (docs/scaling.md, "Planning")."""
