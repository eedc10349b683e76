"""Flyte workflows (``pyflyte run workflows/grpo.py grpo``)."""
