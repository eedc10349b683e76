"""Objectives by name: ``algorithm.name`` -> the class the trainer drives.

An objective turns a scored rollout batch into work units for ``Trainer`` and has
``train_step(trainer, traj, active, step) -> metrics``; optional hooks: ``rollout_state()`` (the
LoRA the engine samples with, when it is not the live policy), ``state_tensors()`` /
``load_state_tensors()`` (its own checkpointed tensors) and ``rollout_sde_type`` (the dynamics its
rollouts need, when not the configured ones). A new objective is one module in ``training/`` plus
one line here (docs/architecture.md, "Where things go").
"""

from __future__ import annotations

import importlib

# name -> "module:Class", imported on first use so that one objective's imports cost the others nothing
OBJECTIVES = {
    "flow_grpo": "diffusionrl.training.flow_grpo:FlowGRPOObjective",
    "nft": "diffusionrl.training.nft:NFTObjective",
    "grpo_guard": "diffusionrl.training.grpo_guard:GRPOGuardObjective",
    "dppo": "diffusionrl.training.dppo:DPPOObjective",
    "awm": "diffusionrl.training.awm:AWMObjective",
    "dpo": "diffusionrl.training.dpo:DPOObjective",
    "sft": "diffusionrl.training.sft:SFTObjective",  # driven by training.sft.SFTBackend, not ImageBackend
}


def objective_class(name: str):
    if name not in OBJECTIVES:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(OBJECTIVES)}")
    module, cls = OBJECTIVES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_objective(cfg, policy):
    """The objective of ``cfg.algorithm.name`` over ``policy``."""
    return objective_class(cfg.algorithm.name)(cfg, policy)
