"""What every rollout engine does with a batch around the sampling itself.

Before: the per-sample group ids and seeds as int64 vectors, the per-sample SDE step set and the
micro-batch composition the trajectory records. After: the ``Trajectory`` from the sampled
schedule, latents, log-probs, conditioning and images. The local and the SGLang engine share this
(``RolloutBatch.prepare`` / ``RolloutBatch.trajectory``); how they sample differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffusionrl.algorithms.sde import compressed_steps
from diffusionrl.trajectory import Conditioning, Trajectory

from .base import SamplingSpec


def as_long(values, n: int, name: str) -> torch.Tensor:
    """``values`` (a list or tensor, one entry per prompt) as an int64 vector ``[n]``."""
    t = torch.as_tensor(values, dtype=torch.int64).reshape(-1)
    if t.shape[0] != n:
        raise ValueError(f"{name} has {t.shape[0]} entries for {n} prompts")
    return t


def resolve_sde_mask(spec: SamplingSpec, batch_size: int, sde_mask: np.ndarray | torch.Tensor | None) -> torch.Tensor:
    """The SDE steps of each sample, ``[B, T]`` bool: none when sampling ODE; every step but the
    last when no mask is given; a ``[T]`` mask holds for every sample; a ``[B, T]`` one is kept."""
    b, t = batch_size, spec.num_steps
    if spec.sde_type == "ode" or sde_mask is None:
        mask = torch.zeros(b, t, dtype=torch.bool)
        if spec.sde_type != "ode":
            mask[:, :-1] = True
        return mask
    mask = torch.as_tensor(np.asarray(sde_mask), dtype=torch.bool)
    return mask.expand(b, t).clone() if mask.ndim == 1 else mask


@dataclass
class RolloutBatch:
    """One ``generate`` call's batch, validated, with the choices both engines make the same way."""

    prompts: list[str]  # [B]
    group_ids: torch.Tensor  # [B] int64
    seeds: torch.Tensor  # [B] int64
    sde_mask: torch.Tensor  # [B, T] bool
    micro_batch_size: int  # the engine's micro-batch size if it divides B, else B
    spec: SamplingSpec
    metadata: list[dict] | None = None

    @classmethod
    def prepare(
        cls,
        prompts: list[str],
        group_ids,
        seeds,
        spec: SamplingSpec,
        sde_mask: np.ndarray | torch.Tensor | None,
        micro_batch_size: int,
        metadata: list[dict] | None = None,
    ) -> RolloutBatch:
        b = len(prompts)
        group_ids_t = as_long(group_ids, b, "group_ids")
        seeds_t = as_long(seeds, b, "seeds")
        return cls(
            prompts=list(prompts),
            group_ids=group_ids_t,
            seeds=seeds_t,
            sde_mask=resolve_sde_mask(spec, b, sde_mask),
            micro_batch_size=micro_batch_size if b % micro_batch_size == 0 else b,
            spec=spec,
            metadata=metadata,
        )

    def schedule(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The schedule the batch samples on: the model's ``sigmas [T+1]`` and ``timesteps [T]``, or with
        ``spec.post_window_ode_steps`` their MixGRPO-Flash compression (``algorithms.sde.compressed_steps``),
        to which ``sde_mask`` is narrowed (the trajectory records the steps actually taken)."""
        keep = torch.as_tensor(compressed_steps(self.sde_mask, self.spec.num_steps, self.spec.post_window_ode_steps))
        if len(keep) == len(sigmas):
            return sigmas, timesteps
        self.sde_mask = self.sde_mask[:, keep[:-1]]
        return sigmas[keep], timesteps[keep[:-1]]

    @property
    def size(self) -> int:
        return len(self.prompts)

    @property
    def latent_seeds(self) -> torch.Tensor:
        """``[B]`` the seed of each sample's initial latent: its own seed, or with ``spec.same_latent``
        the seed of its group's first sample in the batch (so the latent does not depend on micro-batches)."""
        if not self.spec.same_latent:
            return self.seeds
        first: dict[int, int] = {}
        for i, g in enumerate(self.group_ids.tolist()):
            first.setdefault(g, i)
        return self.seeds[torch.as_tensor([first[g] for g in self.group_ids.tolist()], dtype=torch.long)]

    def trajectory(
        self,
        *,
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        latents: torch.Tensor,
        log_probs: torch.Tensor,
        conditioning: Conditioning,
        images: np.ndarray | None,
        policy_version: int,
    ) -> Trajectory:
        """The sampled batch as a ``Trajectory`` (shapes as ``Trajectory`` documents them)."""
        spec = self.spec
        return Trajectory(
            prompts=self.prompts,
            group_ids=self.group_ids,
            seeds=self.seeds,
            sigmas=sigmas,
            timesteps=timesteps,
            sde_mask=self.sde_mask,
            latents=latents,
            log_probs=log_probs,
            conditioning=conditioning,
            guidance_scale=float(spec.guidance_scale),
            guidance_scale_2=None if spec.guidance_scale_2 is None else float(spec.guidance_scale_2),
            sde_type=spec.sde_type,
            noise_level=float(spec.noise_level),
            micro_batch_size=self.micro_batch_size,
            policy_version=policy_version,
            images=images,
            metadata=self.metadata,
        )
