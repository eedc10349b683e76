"""Model-family adapter for FLUX.2 [dev] (diffusers ``Flux2Pipeline``).

What differs from FLUX.1, and where the adapter absorbs it:
- Latents: AutoencoderKLFlux2's 32-channel latent, patchified 2x2 into 128 channels and normalised
  by the VAE's batch-norm statistics; the pipeline samples in that ``[B, 128, H/16, W/16]`` space
  (its ``latents=`` argument), which is what trajectories keep. Tokens are that tensor flattened
  (``_pack_latents``: one 128-channel token per position, no further 2x2 packing), with 4-axis
  position ids ``(t, h, w, l)`` (``_prepare_latent_ids``); ``decode`` undoes the normalisation and
  the patchify before the VAE, ``encode_images`` does both after it.
- Text: one encoder (Mistral Small 3.1 in FLUX.2 [dev]) over a chat template with FLUX.2's system
  message, padded to ``max_sequence_length``; the embedding is its hidden states at layers 10, 20
  and 30 side by side (``3 x hidden``), every padded token kept (no mask, as the pipeline does), text
  ids ``(0, 0, 0, l)``. No pooled embedding (``[B, 0]``).
- Guidance-distilled (as FLUX.1): the scale is the transformer's ``guidance`` input, one forward,
  no CFG pass; the transformer takes ``timesteps / 1000``.
- Schedule: ``linspace(1, 1/T, T)`` shifted by the pipeline's ``compute_empirical_mu`` of the image
  token count and T.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FlowAdapter
from .tiny_flux2 import TINY_FLUX2_KLEIN_REF, TINY_FLUX2_REF, build_tiny_flux2_klein_pipeline, build_tiny_flux2_pipeline


def unpack_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[B, H W, C]`` -> ``[B, C, H, W]``: the inverse of ``Flux2Pipeline._pack_latents``."""
    return tokens.permute(0, 2, 1).reshape(tokens.shape[0], -1, h, w)


class Flux2Adapter(FlowAdapter):
    """FLUX.2 [dev] behind the interface the engines and the trainer use."""

    family = "flux2"
    pipeline_class = "Flux2Pipeline"
    builtin = TINY_FLUX2_REF
    components = ("transformer", "vae", "text_encoder")
    pipeline_logger = "diffusers.pipelines.flux2.pipeline_flux2"
    cfg_mode = "embedded"  # guidance-distilled: the scale is an input of the transformer, no CFG pass
    # Both streams' attention projections and SwiGLU feed-forwards in the double-stream blocks, the fused
    # QKV+MLP input and the output projection of the single-stream blocks (FLUX.2 [klein] too).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                            "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.linear_in",
                            "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                            "attn.to_qkv_mlp_proj", "attn.to_out")

    @staticmethod
    def build_tiny():
        return build_tiny_flux2_pipeline()

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        side = resolution // (self.vae_scale_factor * 2)  # the pipeline's prepare_latents
        return (self.transformer.config.in_channels, side, side)

    def _timestep_kwargs(self, num_steps: int, resolution: int | None) -> dict:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        if resolution is None:
            raise ValueError("flux2's schedule depends on the resolution (its empirical mu): pass resolution")
        _, h, w = self.latent_shape(resolution)
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps),
                "mu": compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)}

    def from_tokens(self, tokens: torch.Tensor, resolution: int) -> torch.Tensor:
        _, h, w = self.latent_shape(resolution)
        return unpack_tokens(tokens, h, w)

    def from_pipeline_latents(self, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        return self.from_tokens(latents, resolution)  # Flux2Pipeline's output_type="latent" is the token sequence

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        embeds, _ = self.pipe.encode_prompt(prompt=list(texts), device=self.device,
                                            max_sequence_length=max_sequence_length)
        return embeds, embeds.new_zeros(embeds.shape[0], 0), None

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        return [(self.pipe.tokenizer, max_sequence_length,
                 f"the templated prompt cut to model.max_sequence_length={max_sequence_length} tokens")]

    def _forward(self, transformer, x, t, side, guidance_scale, dtype) -> torch.Tensor:
        """One forward on the flattened latent tokens, with the guidance embedding where the model has
        one (``guidance_input``); FLUX.2 [klein] base runs it once per side (``cfg_mode``)."""
        pipe = type(self.pipe)
        embeds = side.embeds.to(self.device, dtype)
        return transformer(hidden_states=pipe._pack_latents(x), timestep=t / 1000,
                           guidance=self.guidance_input(x.shape[0], guidance_scale), encoder_hidden_states=embeds,
                           txt_ids=pipe._prepare_text_ids(embeds).to(self.device),
                           img_ids=pipe._prepare_latent_ids(x).to(self.device), return_dict=False)[0]

    def _unpack(self, v: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return unpack_tokens(v, *latents.shape[-2:])

    # -- images: batch-norm statistics and the 2x2 patchify around the VAE ---------------------------
    def _bn(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    @torch.no_grad()
    def encode_images(self, images: np.ndarray) -> torch.Tensor:
        vae = self.pipe.vae
        x = torch.as_tensor(np.asarray(images), device=self.device).permute(0, 3, 1, 2).to(vae.dtype) / 127.5 - 1
        z = type(self.pipe)._patchify_latents(vae.encode(x).latent_dist.mode())
        mean, std = self._bn(z)
        return ((z - mean) / std).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype)
        mean, std = self._bn(z)
        image = vae.decode(type(self.pipe)._unpatchify_latents(z * std + mean), return_dict=False)[0].float()
        image = (image / 2 + 0.5).clamp(0, 1)
        return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()


class Flux2KleinAdapter(Flux2Adapter):
    """FLUX.2 [klein] (``Flux2KleinPipeline``): FLUX.2's transformer without a guidance embedding,
    Qwen3's hidden states at layers 9, 18 and 27 (one user turn of its chat template, no system
    message), and, for the undistilled base models (``is_distilled`` false), a CFG pass on the empty
    negative prompt at ``g > 1``; the step-distilled models sample without one."""

    family = "flux2-klein"
    pipeline_class = "Flux2KleinPipeline"
    builtin = TINY_FLUX2_KLEIN_REF
    pipeline_logger = "diffusers.pipelines.flux2.pipeline_flux2_klein"
    cfg_mode = "separate"  # as Flux2KleinPipeline: a second forward on the negative text

    @staticmethod
    def build_tiny():
        return build_tiny_flux2_klein_pipeline()

    def needs_negative(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0 and not self.pipe.config.get("is_distilled", False)

    def pipeline_kwargs(self, guidance_scale: float, negative_prompt) -> dict:
        return {"guidance_scale": guidance_scale}  # the pipeline's negative prompt is always ""

    def from_pipeline_latents(self, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        # Flux2KleinPipeline's output_type="latent" is the VAE's latent (batch-norm undone, unpatchified)
        z = type(self.pipe)._patchify_latents(latents)
        mean, std = self._bn(z)
        return (z - mean) / std
