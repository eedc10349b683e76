"""Model-family adapter for Z-Image (diffusers ``ZImagePipeline``; Z-Image-Turbo).

What differs from SD3, FLUX and Qwen-Image, and where the adapter absorbs it:
- Text: one encoder (Qwen3), its second-to-last hidden state over a chat template, padding tokens
  dropped, so each prompt has its own length; the conditioning pads them to the batch's longest
  with a token mask (``Conditioning.prompt_embeds_mask``), and ``velocity`` hands the transformer
  each prompt's real tokens as a list, as the pipeline does. No pooled embedding (``[B, 0]``).
- The transformer takes lists of per-sample latents ``[C, 1, H, W]`` and the time ``1 - sigma``
  (``(1000 - t) / 1000``), and predicts the negative of the flow-matching velocity (the pipeline
  negates it before its Euler step).
- Guidance: the pipeline's ``guidance_scale`` s mixes ``pos + s (pos - neg)``; ours is the usual
  ``g`` of ``neg + g (pos - neg)`` (1 = no CFG pass), i.e. ``s = g - 1``: ``pipeline_kwargs`` passes
  ``g - 1``. Z-Image-Turbo samples without CFG (s = 0, our g = 1). Positive and negative go through
  one forward of 2B, as in the pipeline.
- Schedule: ``linspace(1, 1/T, T)`` through the scheduler's (static, 3.0 for Turbo) shift; a
  dynamic shift, where configured, gets the pipeline's ``mu`` from the image token count.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FlowAdapter
from .packed import calculate_shift
from .textside import pad_embeds, unpad_embeds
from .tiny_zimage import TINY_ZIMAGE_REF, build_tiny_zimage_pipeline


class ZImageAdapter(FlowAdapter):
    """Z-Image behind the interface the engines and the trainer use."""

    family = "zimage"
    pipeline_class = "ZImagePipeline"
    builtin = TINY_ZIMAGE_REF
    components = ("transformer", "vae", "text_encoder")
    pipeline_logger = "diffusers.pipelines.z_image.pipeline_z_image"
    cfg_negative_first = False  # one forward of 2B, positive first, as ZImagePipeline
    # Every block's (noise refiner, context refiner, joint) attention projections and SwiGLU feed-forward.
    default_lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")

    @staticmethod
    def build_tiny():
        return build_tiny_zimage_pipeline()

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        side = 2 * (resolution // (self.vae_scale_factor * 2))  # the pipeline rounds to whole 2x2 patches
        return (self.transformer.config.in_channels, side, side)

    def _timestep_kwargs(self, num_steps: int, resolution: int | None) -> dict:
        config = self.scheduler.config
        kwargs: dict = {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps).tolist()}
        if config.get("use_dynamic_shifting", False):
            if resolution is None:
                raise ValueError("zimage's schedule depends on the resolution (dynamic shifting): pass resolution")
            _, h, w = self.latent_shape(resolution)
            kwargs["mu"] = calculate_shift(
                (h // 2) * (w // 2), config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.15),
            )
        return kwargs

    def needs_negative(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0  # the pipeline's do_classifier_free_guidance (its scale g - 1 > 0)

    @staticmethod
    def served_guidance(guidance_scale: float) -> float:
        return max(guidance_scale - 1.0, 0.0)  # the pipeline's s = g - 1 (0: no CFG pass)

    def pipeline_kwargs(self, guidance_scale: float, negative_prompt) -> dict:
        if self.needs_negative(guidance_scale):
            return {"guidance_scale": self.served_guidance(guidance_scale), "negative_prompt": negative_prompt}
        return {"guidance_scale": 0.0}

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        # _encode_prompt writes the templated text back into its list: hand it a copy
        embeds, mask = pad_embeds(self.pipe._encode_prompt(prompt=list(texts), device=self.device,
                                                           max_sequence_length=max_sequence_length))
        return embeds, embeds.new_zeros(embeds.shape[0], 0), mask

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        return [(self.pipe.tokenizer, max_sequence_length,
                 f"Qwen3 embeddings of the templated prompt cut to model.max_sequence_length={max_sequence_length}")]

    def _forward(self, transformer, x, t, side, guidance_scale, dtype) -> torch.Tensor:
        """One forward on per-sample latents ``[C, 1, H, W]``, each prompt's real tokens and the time
        ``1 - sigma``; the transformer predicts the negative velocity."""
        embeds = unpad_embeds(side.embeds.to(self.device, dtype), side.mask)
        out = transformer(list(x.unsqueeze(2).unbind(0)), (1000 - t) / 1000, embeds, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)
