"""Model-family adapter for Wan2.1 text-to-video (diffusers ``WanPipeline``).

What differs from SD3 (``models/sd3.py``), and where the adapter absorbs it:
- Video: latents are 5-D ``[B, C, F', H/8, W/8]`` with ``F' = (F - 1) // 4 + 1`` latent frames for
  ``F`` pixel frames (AutoencoderKLWan: 4x temporal, 8x spatial). ``sample_shape(resolution,
  num_frames)`` gives ``(C, F', H/8, W/8)``; the SDE step and the objectives reduce over all
  non-batch dims, so a video is one sample. ``decode`` gives uint8 frames ``[B, F, H, W, 3]``.
- Text: UMT5's last hidden state, zero past each prompt's tokens (``WanPipeline.encode_prompt``);
  no pooled embedding: ``Conditioning.pooled_embeds`` is ``[B, 0]``.
- CFG: a second forward on the negative-prompt embeddings when ``guidance_scale > 1`` (the
  pipeline's ``do_classifier_free_guidance``), ``v = v_neg + g (v_pos - v_neg)``; two forwards as
  the stock pipeline runs them (so the ODE parity test compares like with like).
- Timestep: the transformer takes ``t`` (``sigma * 1000``) as the scheduler gives it.
- Latent normalisation: per-channel ``latents_mean`` / ``latents_std`` of the VAE config
  (``z = x * std + mean`` before decoding, computed as the pipeline does).
- Schedule: the scheduler's own sigmas (FlowMatchEuler with shift 3 for ``builtin:tiny-wan``; the
  hub model's UniPC scheduler with ``flow_shift`` and flow sigmas gives its sigmas the same way);
  the engine steps them with its Euler/SDE steps.
- Wan2.2 A14B (``transformer_2`` and ``boundary_ratio`` in the pipeline): the two experts are one
  ``WanExperts`` module that runs the expert of each call's timestep, as the pipeline does; the LoRA
  goes on both or one (``model.lora_experts``, ``expert_targets``); the low-noise expert's steps take
  their own CFG scale where one is given (``sampling.guidance_scale_2``, the pipeline's
  ``guidance_scale_2``: ``step_guidance``).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FlowAdapter
from .tiny_wan import TINY_WAN22_REF, TINY_WAN_REF, build_tiny_wan22_pipeline, build_tiny_wan_pipeline

WAN_HUB_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as one transformer: ``high`` (the pipeline's ``transformer``) at timesteps
    ``t >= boundary`` (``boundary_ratio * num_train_timesteps``), ``low`` (``transformer_2``) below,
    as ``WanPipeline.__call__`` picks them. A call's samples must all be on one side (a step's are:
    they share its timestep), so rollout and recompute of a step use the same expert."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, float(boundary)

    @property
    def config(self):
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    @property
    def transformer_blocks(self) -> list[torch.nn.Module]:
        return [*self.high.blocks, *self.low.blocks]

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def expert(self, timestep) -> str:
        high = torch.as_tensor(timestep).reshape(-1) >= self.boundary
        if bool(high.all()) or not bool(high.any()):
            return "high" if bool(high[0]) else "low"
        raise ValueError(f"one forward of Wan2.2's experts got timesteps on both sides of the boundary {self.boundary}")

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs):
        return getattr(self, self.expert(timestep))(hidden_states=hidden_states, timestep=timestep, **kwargs)


class WanAdapter(FlowAdapter):
    """Wan2.1 / Wan2.2 T2V behind the interface the engines and the trainer use. With a
    ``transformer_2`` and a ``boundary_ratio`` (Wan2.2 A14B) the transformer is ``WanExperts``."""

    family = "wan"
    pipeline_class = "WanPipeline"
    builtin = TINY_WAN_REF
    components = ("transformer", "transformer_2", "vae", "text_encoder")
    pipeline_logger = "diffusers.pipelines.wan.pipeline_wan"
    video = True
    cfg_mode = "separate"  # as WanPipeline: a second forward on the negative text
    # flow_grpo's scripts/train_wan2_1.py: the attention projections (as suffixes they match the
    # self-attention attn1 and the cross-attention attn2 of every block; its add_* names are I2V-only).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    experts: WanExperts | None = None  # Wan2.2's pair (set in __init__); None: one transformer
    two_expert_builtins = (TINY_WAN22_REF,)  # what families.two_experts knows without building them

    def __init__(self, pipe, device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None):
        super().__init__(pipe, device, autocast_dtype)
        ratio = pipe.config.get("boundary_ratio")
        if getattr(pipe, "transformer_2", None) is not None and ratio is not None:
            self.experts = WanExperts(pipe.transformer, pipe.transformer_2,
                                      ratio * pipe.scheduler.config.num_train_timesteps)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.experts if self.experts is not None else self.pipe.transformer

    @staticmethod
    def build_tiny():
        return build_tiny_wan_pipeline()

    @classmethod
    def builtins(cls) -> dict:
        return {**super().builtins(), TINY_WAN22_REF: build_tiny_wan22_pipeline}

    def step_guidance(self, t: torch.Tensor, guidance_scale: float, guidance_scale_2: float | None = None) -> float:
        """``WanPipeline``'s ``current_guidance_scale``: ``guidance_scale`` on the high-noise expert's steps,
        ``guidance_scale_2`` (None: ``guidance_scale``) on the low-noise expert's."""
        if self.experts is None or guidance_scale_2 is None:
            return super().step_guidance(t, guidance_scale, guidance_scale_2)
        return guidance_scale if self.experts.expert(t) == "high" else guidance_scale_2

    def expert_targets(self, names: list[str], experts: str) -> list[str]:
        if self.experts is None:
            return super().expert_targets(names, experts)
        return [n for n in names if n.startswith(f"{experts}.")]

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial)

    @property
    def temporal_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor_temporal)

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of ``num_frames`` pixel frames (the causal VAE keeps the first frame alone)."""
        r = self.temporal_scale_factor
        if num_frames < 1 or (num_frames - 1) % r:
            from diffusionrl.config import ConfigError

            raise ConfigError(f"sampling.num_frames={num_frames}: Wan takes 1 + {r}k frames (1, 5, 9, ..., 81); "
                              "set one of those")
        return (num_frames - 1) // r + 1

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        return (self.transformer.config.in_channels, resolution // f, resolution // f)

    def sample_shape(self, resolution: int, num_frames: int = 1) -> tuple[int, ...]:
        c, h, w = self.latent_shape(resolution)
        return (c, self.latent_frames(num_frames), h, w)

    def needs_negative(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0  # WanPipeline.do_classifier_free_guidance

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        """UMT5 embeddings padded with zeros to ``max_sequence_length``, no pooled embedding, no token
        mask: ``WanPipeline`` zeroes the padding and passes no mask to the transformer."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=texts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
            device=self.device,
        )
        return embeds, embeds.new_zeros(embeds.shape[0], 0), None

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        return [(self.pipe.tokenizer, max_sequence_length, f"UMT5 model.max_sequence_length={max_sequence_length}")]

    def _forward(self, transformer, x, t, side, guidance_scale, dtype) -> torch.Tensor:
        """One forward (``WanExperts`` picks Wan2.2's expert of ``t``); ``[B, C, F', H, W]``."""
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=side.embeds.to(self.device, dtype),
                           return_dict=False)[0]

    # -- videos ---------------------------------------------------------------------------------
    def _mean_std(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.pipe.vae.config
        shape = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean).view(shape).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(shape).to(like.device, like.dtype)
        return mean, inv_std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Clean latents ``[B, C, F', H, W]`` -> uint8 frames ``[B, F, H*8, W*8, 3]`` (as ``WanPipeline``)."""
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype)
        mean, inv_std = self._mean_std(z)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0].float()  # [B, 3, F, H, W]
        video = (video / 2 + 0.5).clamp(0, 1)
        return (video.permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8).cpu().numpy()

    @torch.no_grad()
    def encode_images(self, images: np.ndarray) -> torch.Tensor:
        """uint8 frames ``[B, F, H, W, 3]`` -> clean latents ``[B, C, F', H/8, W/8]`` (the posterior's mode,
        normalised as ``decode`` undoes)."""
        vae = self.pipe.vae
        x = torch.as_tensor(np.asarray(images), device=self.device)
        if x.ndim != 5:
            raise ValueError(f"Wan encodes videos [B, F, H, W, 3]; got shape {tuple(x.shape)}")
        x = x.permute(0, 4, 1, 2, 3).to(vae.dtype) / 127.5 - 1
        z = vae.encode(x).latent_dist.mode()
        mean, inv_std = self._mean_std(z)
        return ((z - mean) * inv_std).float()
