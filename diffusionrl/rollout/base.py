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
    sde_type: str = "sde"  # sde | cps | ode | dance
    noise_level: float = 0.7
    negative_prompt: str = ""
    max_sequence_length: int = 32
    ode_solver: str = "euler"  # euler | heun (deterministic sampling only)
    keep_images: bool = True
    num_frames: int = 1  # video families: pixel frames per sample (Wan: 1 + 4k)
    # a group's samples start from the initial latent of the group's first seed (sampling.same_latent: the
    # training rollouts only; from_config leaves it off, so evaluation samples never share a latent)
    same_latent: bool = False
    # MixGRPO-Flash (sampling.post_window_ode_steps; the training rollouts only, as same_latent): the ODE steps
    # after the last SDE step become this many larger ones (algorithms.sde.compressed_steps); 0 = off
    post_window_ode_steps: int = 0
    # two experts (Wan2.2 A14B): the CFG scale of the low-noise expert's steps; None: guidance_scale
    guidance_scale_2: float | None = None

    @property
    def guidance(self) -> tuple[float, float | None]:
        """``FlowAdapter.velocity``'s guidance arguments: ``guidance_scale, guidance_scale_2``."""
        return self.guidance_scale, self.guidance_scale_2

    @classmethod
    def from_config(cls, cfg, **override) -> SamplingSpec:
        spec = cls(
            resolution=cfg.sampling.resolution,
            num_steps=cfg.sampling.num_steps,
            guidance_scale=cfg.sampling.guidance_scale,
            guidance_scale_2=cfg.sampling.guidance_scale_2 or None,
            sde_type=cfg.sampling.sde_type,
            noise_level=cfg.sampling.noise_level,
            negative_prompt=cfg.sampling.negative_prompt,
            max_sequence_length=cfg.model.max_sequence_length,
            ode_solver=cfg.sampling.ode_solver,
            num_frames=cfg.sampling.num_frames,
        )
        for key, value in override.items():
            setattr(spec, key, value)
        return spec


class RolloutEngine(Protocol):
    """Generates trajectories with the current policy weights and accepts new ones.

    Engines must give the same log-probs for the same weights and noise: the local engine
    (``rollout/local.py``) and the SGLang engine (``rollout/sglang/``) are interchangeable behind
    this protocol. Both are built by ``rollout.factory.make_engine``.
    """

    name: str  # "local" | "sglang"
    version: int  # the weight version of the last ``update_weights`` (0 before any)

    def generate(
        self,
        prompts: list[str],
        group_ids: list[int] | torch.Tensor,
        seeds: list[int] | torch.Tensor,
        spec: SamplingSpec,
        sde_mask: np.ndarray | torch.Tensor | None = None,
        metadata: list[dict] | None = None,
    ) -> Trajectory:
        """Sample one trajectory per prompt with the weights of the last ``update_weights``.

        Args:
            prompts (`list[str]`): B prompts.
            group_ids (`list[int]` or `torch.Tensor`): ``[B]``, the GRPO group of each sample.
            seeds (`list[int]` or `torch.Tensor`): ``[B]``, sample i's noise comes from ``seeds[i]``.
            spec (`SamplingSpec`): steps, resolution, guidance, SDE type and noise level, what to keep.
            sde_mask (`np.ndarray` or `torch.Tensor`, *optional*, defaults to `None`): the stochastic steps,
                ``[B, T]`` or ``[T]`` for all samples; `None`: every step but the last.
            metadata (`list[dict]`, *optional*, defaults to `None`): the B prompt rows' fields (an editing
                row's input ``image``).

        Returns:
            `Trajectory`: latents ``[B, T+1, ...]`` (noise to clean), per-step log-probs ``[B, T]`` (0 at
            deterministic steps), the schedule, the SDE mask, the conditioning, seeds and group ids, and the
            decoded images when ``spec.keep_images``.
        """
        ...

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Sample with these trained tensors (the policy's ``lora_state()``: a LoRA, or a full fine-tune's
        every transformer parameter) from now on."""
        ...

    def release_memory(self) -> None:
        """Free the engine's accelerator memory while the trainer trains (no-op where nothing is
        held apart from the trainer's allocator)."""
        ...

    def resume_memory(self) -> None:
        """Take back what ``release_memory`` freed, before the next ``generate``."""
        ...

    def close(self) -> None:
        """Release what the engine owns (a server process, temporary files); idempotent."""
        ...
