"""2x2-packed latent tokens and the resolution-dependent schedule shift: what FLUX.1 and
Qwen-Image share (``PackedLatents``, a mixin of their adapters).

Both transformers take 2x2 patches of the 16-channel, 8x-compressed VAE latent as 64-channel
tokens ``[B, (H/2)(W/2), 64]``; both pipelines sample ``sigmas = linspace(1, 1/T, T)`` shifted by
``mu``, linear in the number of image tokens, when the scheduler uses dynamic shifting (the
constants come from the scheduler's config); both transformers take ``timesteps / 1000``.
Trajectories keep spatial latents ``[B, 16, H, W]``: ``pack``/``unpack`` are permutations.
"""

from __future__ import annotations

import numpy as np
import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, (H/2)(W/2), 4C]`` (the pipelines' ``_pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[B, (H/2)(W/2), 4C]`` -> ``[B, C, H, W]`` (the pipelines' ``_unpack_latents``)."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def calculate_shift(image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float,
                    max_shift: float) -> float:
    """The resolution-dependent shift ``mu``: linear in the number of image tokens."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


class PackedLatents:
    """Mixin of a ``FlowAdapter`` whose transformer takes 2x2-packed latent tokens."""

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        """16 channels at ``2 * (resolution // 16)``: the pipelines round to whole 2x2 patches."""
        side = 2 * (resolution // (self.vae_scale_factor * 2))
        return (self.transformer.config.in_channels // 4, side, side)

    def image_seq_len(self, resolution: int) -> int:
        _, h, w = self.latent_shape(resolution)
        return (h // 2) * (w // 2)

    def _timestep_kwargs(self, num_steps: int, resolution: int | None) -> dict:
        config = self.scheduler.config
        kwargs: dict = {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps)}
        if getattr(config, "use_flow_sigmas", False):
            kwargs = {"num_inference_steps": num_steps}
        if config.get("use_dynamic_shifting", False):
            if resolution is None:
                raise ValueError(f"{self.family}'s schedule depends on the resolution (dynamic shifting): pass "
                                 "resolution")
            kwargs["mu"] = calculate_shift(
                self.image_seq_len(resolution), config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.15),
            )
        return kwargs

    def to_pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return pack(latents)

    def from_pipeline_latents(self, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        _, h, w = self.latent_shape(resolution)
        return unpack(latents, h, w)
