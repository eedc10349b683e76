"""The rollout engine protocol: what the training loop needs from whatever samples images."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from diffusionrl.trajectory import Trajectory


@dataclass
class SamplingSpec:
    """How one batch is sampled (a view of ``SamplingConfig`` plus per-call choices)."""

    resolution: int
    num_steps: int
    guidance_scale: float
    sde_type: str = "sde"  # sde | cps | ode
    noise_level: float = 0.7
    negative_prompt: str = ""
    max_sequence_length: int = 32
    ode_solver: str = "euler"  # euler | heun (deterministic sampling only)
    keep_images: bool = True

    @classmethod
    def from_config(cls, cfg, **override) -> "SamplingSpec":
        spec = cls(
            resolution=cfg.sampling.resolution,
            num_steps=cfg.sampling.num_steps,
            guidance_scale=cfg.sampling.guidance_scale,
            sde_type=cfg.sampling.sde_type,
            noise_level=cfg.sampling.noise_level,
            negative_prompt=cfg.sampling.negative_prompt,
            max_sequence_length=cfg.model.max_sequence_length,
            ode_solver=cfg.sampling.ode_solver,
        )
        for key, value in override.items():
            setattr(spec, key, value)
        return spec


class RolloutEngine(Protocol):
    """Generates trajectories with the current policy weights and accepts new ones.

    Engines must give the same log-probs for the same weights and noise: the local engine and
    the SGLang engine are interchangeable behind this protocol.
    """

    name: str
    version: int

    def generate(
        self,
        prompts: list[str],
        group_ids: list[int] | torch.Tensor,
        seeds: list[int] | torch.Tensor,
        spec: SamplingSpec,
        sde_mask: np.ndarray | torch.Tensor | None = None,
        metadata: list[dict] | None = None,
    ) -> Trajectory: ...

    def update_weights(self, lora_state: dict[str, torch.Tensor], version: int) -> None: ...

    def close(self) -> None: ...
