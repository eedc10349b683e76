"""Model-family adapter for Qwen-Image (diffusers ``QwenImagePipeline``).

What differs from SD3 and FLUX, and where the adapter absorbs it:
- Text: one encoder, Qwen2.5-VL's last hidden state over a chat template (its leading 34 tokens
  dropped), cut to ``max_sequence_length``; prompts are padded to the longest one of the encoded
  batch, so the conditioning carries a token mask (``Conditioning.prompt_embeds_mask``; None when no
  token is padding, as diffusers does). No pooled embedding: ``pooled_embeds`` is ``[B, 0]``.
- True CFG (no guidance embedding): at ``guidance_scale > 1`` (diffusers' ``true_cfg_scale``) two
  forwards, positive and negative (their text lengths differ), mixed as
  ``c = v_neg + g (v_pos - v_neg)`` and rescaled per token to the positive prediction's norm,
  ``c |v_pos| / |c|`` (norms over each packed token's 64 channels, as the pipeline does).
- Packed latents, ``t / 1000`` and the resolution-dependent shift: ``models/packed.py``; the RoPE
  positions come from ``img_shapes`` (``(1, H/2, W/2)`` per sample) and the text lengths.
- VAE: a causal video VAE (one frame), latents normalised per channel by ``latents_mean`` /
  ``latents_std`` instead of a scaling and shift factor.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FlowAdapter
from .packed import PackedLatents, pack, unpack
from .tiny_qwen_image import TINY_QWEN_IMAGE_REF, build_tiny_qwen_image_pipeline


class QwenImageAdapter(PackedLatents, FlowAdapter):
    """Qwen-Image behind the interface the engines and the trainer use."""

    family = "qwen-image"
    pipeline_class = "QwenImagePipeline"
    builtin = TINY_QWEN_IMAGE_REF
    components = ("transformer", "vae", "text_encoder")
    pipeline_logger = "diffusers.pipelines.qwenimage.pipeline_qwenimage"
    cfg_mode = "separate"  # true CFG: the positive and negative texts differ in length
    cfg_norm_rescale = True
    # Both streams' attention projections and MLPs (``dead_lora_targets`` drops the last block's text outputs).
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                            "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                            "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

    @staticmethod
    def build_tiny():
        return build_tiny_qwen_image_pipeline()

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.pipe.vae.temperal_downsample)

    def dead_lora_targets(self) -> set[str]:
        # The last block's text-stream outputs are discarded (only the image stream reaches
        # proj_out): its text queries, text output projection and text MLP get exactly 0 gradient.
        last = f"transformer_blocks.{len(self.transformer.transformer_blocks) - 1}"
        return {f"{last}.{name}" for name in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj",
                                              "txt_mlp.net.2")}

    def needs_negative(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0  # the pipeline's do_true_cfg (with a negative prompt, which we always give)

    def pipeline_kwargs(self, guidance_scale: float, negative_prompt) -> dict:
        return self.true_cfg_kwargs(guidance_scale, negative_prompt)

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        embeds, mask = self.pipe.encode_prompt(prompt=texts, device=self.device,
                                               max_sequence_length=max_sequence_length)
        return embeds, embeds.new_zeros(embeds.shape[0], 0), mask

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        return [(self.pipe.tokenizer, max_sequence_length,
                 f"Qwen2.5-VL embeddings cut to model.max_sequence_length={max_sequence_length}")]

    def _forward(self, transformer, x, t, side, guidance_scale, dtype) -> torch.Tensor:
        """One forward on the packed latents (per packed token: the CFG rescale's norm)."""
        h, w = x.shape[-2:]
        return transformer(
            hidden_states=pack(x),
            timestep=t / 1000,
            guidance=None,
            encoder_hidden_states_mask=None if side.mask is None else side.mask.to(self.device),
            encoder_hidden_states=side.embeds.to(self.device, dtype),
            img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
            return_dict=False,
        )[0]

    def _unpack(self, v: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return unpack(v, *latents.shape[-2:])

    # -- images: the video VAE on one frame, per-channel normalisation ----------------------------
    def _stats(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(self.device, dtype)
        std_inv = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(self.device, dtype)
        return mean, std_inv

    @torch.no_grad()
    def encode_images(self, images: np.ndarray) -> torch.Tensor:
        vae = self.pipe.vae
        x = torch.as_tensor(np.asarray(images), device=self.device).permute(0, 3, 1, 2).to(vae.dtype) / 127.5 - 1
        z = vae.encode(x[:, :, None]).latent_dist.mode()  # [B, C, 1, h, w]
        mean, std_inv = self._stats(z.dtype)
        return ((z - mean) * std_inv)[:, :, 0].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype)[:, :, None]  # [B, C, 1, H, W]
        mean, std_inv = self._stats(z.dtype)
        image = vae.decode(z / std_inv + mean, return_dict=False)[0][:, :, 0].float()
        image = (image / 2 + 0.5).clamp(0, 1)
        return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()
