"""Model-family adapter for Stable Diffusion 3 / 3.5 (diffusers ``StableDiffusion3Pipeline``).

Three text encoders (two CLIP, pooled; T5, sequence), true classifier-free guidance (one forward
on ``[x; x]`` with ``[negative; positive]``), spatial latents patchified inside the transformer,
a static shift of the sigma schedule. The shared machinery is ``models/base.py``.
"""

from __future__ import annotations

import torch

from diffusionrl.hub import hf_token

from .base import DTYPES, FlowAdapter, module_digest, resolve_device
from .tiny import TINY_REF, build_tiny_sd3_pipeline

__all__ = ["DTYPES", "SD3Adapter", "hf_token", "module_digest", "resolve_device"]


class SD3Adapter(FlowAdapter):
    """Stable Diffusion 3 behind the small interface the engines and the trainer use."""

    family = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    builtin = TINY_REF
    components = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    pipeline_logger = "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3"
    # The attention projections (both streams) the SD3.5 reference recipes adapt.
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                            "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

    @staticmethod
    def build_tiny():
        return build_tiny_sd3_pipeline()

    @classmethod
    def builtins(cls) -> dict:
        # builtin:tiny-sd3-shapes: the same architecture, pretrained on the shapes world (shipped weights)
        from .tiny_shapes import SHAPES_REF, build_shapes_pipeline

        return {**super().builtins(), SHAPES_REF: build_shapes_pipeline}

    def dead_lora_targets(self) -> set[str]:
        # In SD3's last block (context_pre_only) the text tokens' outputs are discarded, so the
        # text-query projection there cannot change the prediction: its gradient is exactly 0.
        # An adapter on it would be dead weight (it never trains), so it is left out.
        return {
            f"transformer_blocks.{i}.attn.add_q_proj"
            for i, block in enumerate(self.transformer.transformer_blocks)
            if getattr(block, "context_pre_only", False)
        }

    def _encode(self, texts: list[str], max_sequence_length: int) -> tuple:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        return embeds, pooled, None

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        limits = super()._token_limits(max_sequence_length)
        if getattr(self.pipe, "tokenizer_3", None) is not None:
            limits.append((self.pipe.tokenizer_3, max_sequence_length,
                           f"T5 model.max_sequence_length={max_sequence_length}"))
        return limits

    def _forward(self, transformer, x, t, side, guidance_scale, dtype) -> torch.Tensor:
        """One forward; a CFG pass goes in the same batch, ``[negative; positive]`` (``cfg_mode``'s default)."""
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=side.embeds.to(self.device, dtype),
                           pooled_projections=side.pooled.to(self.device, dtype), return_dict=False)[0]
