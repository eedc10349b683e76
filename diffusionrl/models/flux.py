"""Model-family adapter for FLUX.1 (diffusers ``FluxPipeline``).

What differs from SD3 (``models/sd3.py``), and where the adapter absorbs it:
- Guidance-distilled: ``guidance_scale`` is an input of the transformer (its guidance embedding,
  FLUX.1-dev's default 3.5), not a CFG mix; there is no negative pass (``needs_negative`` is
  False), so one forward per step. A transformer without a guidance embedding (FLUX.1 [schnell], a
  Kontext model trained with instruction dropout) takes true CFG instead, as the pipelines'
  ``true_cfg_scale`` with a ``negative_prompt``: at ``guidance_scale > 1`` a second forward on the negative
  text (the input image's tokens on both sides), mixed ``v_neg + g (v - v_neg)``; at ``<= 1`` none.
- Packed latents (``models/packed.py``, shared with Qwen-Image): the transformer takes 2x2 patches
  of the 16-channel VAE latent as 64-channel tokens ``[B, (H/2)(W/2), 64]`` with position ids
  (``img_ids``: row/column per token, ``txt_ids``: zeros per text token) for its RoPE.
  Trajectories keep the spatial latent ``[B, 16, H, W]``; ``velocity`` packs, runs, and unpacks
  (pure permutations: exact).
- Timestep: the transformer takes ``t / 1000`` (it multiplies by 1000 inside), as the pipeline does.
- Text: the pooled output of CLIP (``CLIPTextModel``), T5's sequence; one encoder pair, no
  ``tokenizer_3``.
- Schedule (``models/packed.py``): ``sigmas = linspace(1, 1/T, T)`` shifted by ``mu``, linear in the
  number of image tokens, when the scheduler uses dynamic shifting (FLUX.1-dev does): the schedule
  depends on the resolution.
"""

from __future__ import annotations

import torch

from .base import FlowAdapter
from .packed import PackedLatents, pack, unpack
from .textside import TextSide
from .tiny_flux import TINY_FLUX_REF, build_tiny_flux_pipeline

__all__ = ["FluxAdapter", "image_ids", "pack", "unpack"]


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Position ids ``[(H/2)(W/2), 3]`` of the packed tokens (``FluxPipeline._prepare_latent_image_ids``)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h // 2)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxAdapter(PackedLatents, FlowAdapter):
    """FLUX.1 behind the interface the engines and the trainer use."""

    family = "flux"
    pipeline_class = "FluxPipeline"
    builtin = TINY_FLUX_REF
    components = ("transformer", "vae", "text_encoder", "text_encoder_2")
    pipeline_logger = "diffusers.pipelines.flux.pipeline_flux"
    # flow_grpo's scripts/train_flux.py: both streams' attention projections and feed-forwards of the
    # double-stream blocks (the single-stream blocks' attn.to_q/k/v match by suffix too).
    default_lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                            "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                            "ff_context.net.0.proj", "ff_context.net.2")

    @staticmethod
    def build_tiny():
        return build_tiny_flux_pipeline()

    @property
    def cfg_mode(self) -> str:
        """``embedded`` (guidance-distilled: the scale is an input of the transformer, no CFG pass) or, for a
        transformer without a guidance embedding, ``separate`` (true CFG: one forward per side, as the pipeline).
        A stub adapter with no transformer (the fit planner's) is FLUX.1 [dev]'s: embedded."""
        config = getattr(self.transformer, "config", None)
        return "separate" if config is not None and not config.guidance_embeds else "embedded"

    def needs_negative(self, guidance_scale: float) -> bool:
        return self.cfg_mode == "separate" and guidance_scale > 1.0  # the pipeline's do_true_cfg

    def pipeline_kwargs(self, guidance_scale: float, negative_prompt) -> dict:
        if self.cfg_mode == "embedded":
            return super().pipeline_kwargs(guidance_scale, negative_prompt)  # the scale alone: no negative pass
        return self.true_cfg_kwargs(guidance_scale, negative_prompt)

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=max_sequence_length,
        )
        return embeds, pooled, None

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        return super()._token_limits(max_sequence_length) + [
            (self.pipe.tokenizer_2, max_sequence_length, f"T5 model.max_sequence_length={max_sequence_length}")
        ]

    def _forward(self, transformer, x, t, side, guidance_scale, dtype) -> torch.Tensor:
        """One forward on the packed latents (and, for FLUX.1 Kontext, the input image's: ``image_tokens``)
        with the guidance embedding (``guidance_input``)."""
        embeds = side.embeds.to(self.device, dtype)
        hidden, img_ids = self.image_tokens(x, side, dtype)
        return transformer(
            hidden_states=hidden,
            timestep=t / 1000,
            guidance=self.guidance_input(x.shape[0], guidance_scale),
            pooled_projections=side.pooled.to(self.device, dtype),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=self.device, dtype=dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def image_tokens(self, x: torch.Tensor, side: TextSide, dtype: torch.dtype) -> tuple:
        """The transformer's image tokens ``[N, L, 64]`` and their position ids ``[L, 3]``: the packed
        latents ``x`` (FLUX.1 Kontext appends its input image's, ``side.image``: ``models/flux_kontext.py``)."""
        h, w = x.shape[-2:]
        return pack(x), image_ids(h, w, self.device, dtype)

    def _unpack(self, v: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        h, w = latents.shape[-2:]
        return unpack(v[:, : (h // 2) * (w // 2)], h, w)  # the noisy latents' tokens come first
