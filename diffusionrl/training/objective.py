"""Objectives by name: ``algorithm.name`` -> the class the trainer drives.

An objective turns a scored rollout batch into work units for ``Trainer`` and has
``train_step(trainer, traj, active, step) -> metrics``; optional hooks: ``rollout_state()`` (the
LoRA the engine samples with, when it is not the live policy), ``state_tensors()`` /
``load_state_tensors()`` (its own checkpointed tensors). Its rollouts' dynamics follow its record's
``rollouts`` flag (``config.objectives``: SDE objectives sample with ``sampling.sde_type``, the others
ODE). The class of objective ``name`` is the one in
``diffusionrl/training/<name>.py`` whose ``name`` attribute is ``name``; the module is imported on
first use, so that one objective's imports cost the others nothing. The names are those registered
in ``diffusionrl/config/objectives.py`` (docs/architecture.md, "Where things go").
"""

from __future__ import annotations

import importlib

import torch

from diffusionrl.config import ALGORITHMS


def objective_class(name: str):
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    module = importlib.import_module(f"diffusionrl.training.{name}")
    found = [c for c in vars(module).values()
             if isinstance(c, type) and c.__module__ == module.__name__ and getattr(c, "name", None) == name]
    if len(found) != 1:
        raise TypeError(f"{module.__name__} defines {len(found)} classes with name = {name!r}; it must define one")
    return found[0]


def checkpointed_tensors(trainer, objective) -> dict[str, dict[str, torch.Tensor]]:
    """The tensor groups a checkpoint holds besides the trained tensors and the optimizer: the trainer's EMA
    (``ema``) and the objective's own (``state_tensors()``, e.g. NFT's ``old``), as copies."""
    groups = {"ema": trainer.ema.state()} if trainer.ema is not None else {}
    getter = getattr(objective, "state_tensors", None)
    groups.update(getter() if getter else {})
    return groups


def build_objective(cfg, policy):
    """The objective of ``cfg.algorithm.name`` over ``policy``."""
    return objective_class(cfg.algorithm.name)(cfg, policy)
