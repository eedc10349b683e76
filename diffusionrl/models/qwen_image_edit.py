"""Model-family adapter for Qwen-Image-Edit (diffusers ``QwenImageEditPlusPipeline``): image editing.

Qwen-Image-Edit is Qwen-Image (``models/qwen_image.py``: true CFG with the per-token norm rescale, packed
latents, the video VAE) that sees the image to edit twice, as the stock pipeline does it:
- In the text: Qwen2.5-VL encodes the edit template around ``"Picture 1: <|vision_start|><|image_pad|>
  <|vision_end|>" + prompt`` with the input image (resized to ``CONDITION_IMAGE_SIZE`` = 384x384 pixels of
  area at its aspect, then the VL processor's 28-px grid) through its vision tower; its last hidden state,
  the template's 64 leading tokens dropped, is the prompt embedding. The negative prompt is encoded with the
  same image, so both sides differ per input image. The pipeline encodes one prompt at a time (batch 1) and
  cuts nothing (``model.max_sequence_length`` does not apply); ``encode_conditioning`` encodes each distinct
  (prompt, image) pair alone and pads the batch to its longest with a token mask.
- In the latents: the image VAE-encoded (the posterior's mode, normalised per channel) at the sampling
  resolution's area at its aspect in 32-px steps (the pipeline's ``calculate_dimensions`` with
  ``VAE_IMAGE_SIZE`` = resolution^2; the stock value, 1024^2, would dwarf a small training resolution), kept
  spatial in ``Conditioning.image_latents``; its packed tokens follow the noisy latents' in the transformer's
  sequence, ``img_shapes`` lists both grids, and the velocity is the output's first ``(H/2)(W/2)`` tokens.
- The schedule's shift counts the noisy latents' tokens only (as ``PackedLatents`` does).
Without an input image (rows with no ``image``) the prompt is encoded with the edit template and no picture,
and the transformer sees the noisy latents only (the pipeline's encoding with ``image=None``).

Qwen-Image-Edit's first release (``Qwen/Qwen-Image-Edit``, diffusers ``QwenImageEditPipeline``;
``QwenImageEditV1Adapter``) differs in the text side only: its template holds the picture's vision tokens
with no "Picture 1: " label, and the VL encoder sees the input image as the VAE does, at the VAE size (the
pipeline resizes it once, to ``calculate_dimensions(1024 * 1024, aspect)``, and both encoders take that image;
here the sampling resolution's area, as above). The transformer's sequence, the latents and the schedule are
the Plus pipeline's. It edits only: its template holds the picture's vision tokens, which the VL processor
refuses without a picture (the stock call reads the image's size first), so rows without an ``image`` are a
``ConfigError``.
"""

from __future__ import annotations

import numpy as np
import torch

from diffusionrl.trajectory import Conditioning

from .packed import pack
from .qwen_image import QwenImageAdapter
from .references import EditingReferences, image_key
from .textside import TextSide, pad_embeds
from .tiny_qwen_image_edit import (
    TINY_QWEN_IMAGE_EDIT_REF,
    TINY_QWEN_IMAGE_EDIT_V1_REF,
    build_tiny_qwen_image_edit_pipeline,
    build_tiny_qwen_image_edit_v1_pipeline,
)

__all__ = ["QwenImageEditAdapter", "QwenImageEditV1Adapter"]


def pad_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``pad_embeds``, the mask None where no row is padded (as the pipeline's ``encode_prompt`` returns it)."""
    embeds, mask = pad_embeds(rows)
    return embeds, None if bool(mask.all()) else mask


class QwenImageEditAdapter(EditingReferences, QwenImageAdapter):
    """Qwen-Image-Edit (Plus, the 2509/2511 releases' pipeline) behind the interface the engines and the trainer use."""

    family = "qwen-image-edit"
    pipeline_class = "QwenImageEditPlusPipeline"
    builtin = TINY_QWEN_IMAGE_EDIT_REF
    pipeline_logger = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"

    @staticmethod
    def build_tiny():
        return build_tiny_qwen_image_edit_pipeline()

    def _token_limits(self, max_sequence_length: int) -> list[tuple[object, int, str]]:
        return []  # the pipeline's encode_prompt cuts nothing

    # -- the input image ---------------------------------------------------------------------------
    @staticmethod
    def _dimensions(area: int, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` of ``area`` pixels at the image's aspect, in 32-px steps (the pipeline's rule)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        w, h = calculate_dimensions(area, width / height)
        return max(int(h), 32), max(int(w), 32)  # a side the rule rounds to 0 (a thin image) keeps one step

    def reference_size(self, height: int, width: int, resolution: int) -> tuple[int, int]:
        """``(height, width)`` in pixels the input image is VAE-encoded at (see the module docstring)."""
        return self._dimensions(resolution * resolution, height, width)

    def condition_size(self, height: int, width: int, resolution: int) -> tuple[int, int]:
        """``(height, width)`` in pixels the VL text encoder sees the input image at: ``CONDITION_IMAGE_SIZE`` of
        area at its aspect (the Plus pipeline's own size, whatever the output's)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE

        return self._dimensions(CONDITION_IMAGE_SIZE, height, width)

    def condition_image(self, image: np.ndarray, resolution: int):
        """The PIL image the VL text encoder sees: the input resized to ``condition_size`` (the pipeline's resize)."""
        from PIL import Image

        h, w = self.condition_size(*image.shape[:2], resolution)
        return self.pipe.image_processor.resize(Image.fromarray(np.ascontiguousarray(image)), h, w)

    def _encode_reference(self, image: np.ndarray, h: int, w: int) -> torch.Tensor:
        from PIL import Image

        x = self.pipe.image_processor.preprocess(Image.fromarray(np.ascontiguousarray(image)), h, w).unsqueeze(2)
        return self.pipe._encode_vae_image(x.to(self.device, self.pipe.vae.dtype), generator=None)[:, :, 0].float()

    # -- text: prompt and input image together ---------------------------------------------------
    @torch.no_grad()
    def encode_conditioning(self, prompts: list[str], negative_prompt: str | None, max_sequence_length: int,
                            references: list[np.ndarray] | None = None, resolution: int | None = None) -> Conditioning:
        if references is None:
            return super().encode_conditioning(prompts, negative_prompt, max_sequence_length)
        keys = [image_key(im) for im in references]
        pictures: dict = {}
        for key, im in zip(keys, references):
            if key not in pictures:
                pictures[key] = self.condition_image(im, resolution)
        encoded: dict[tuple[str, bytes], torch.Tensor] = {}

        def encode(text: str, key: bytes) -> torch.Tensor:
            if (text, key) not in encoded:
                embeds, _ = self.pipe.encode_prompt(prompt=[text], image=[pictures[key]], device=self.device)
                encoded[text, key] = embeds[0]
            return encoded[text, key]

        b = len(prompts)
        embeds, mask = pad_rows([encode(p, k) for p, k in zip(prompts, keys)])
        cond = Conditioning(embeds, embeds.new_zeros(b, 0), prompt_embeds_mask=mask)
        if negative_prompt is not None:
            neg, neg_mask = pad_rows([encode(negative_prompt, k) for k in keys])
            cond.negative_prompt_embeds, cond.negative_pooled_embeds = neg, neg.new_zeros(b, 0)
            cond.negative_prompt_embeds_mask = neg_mask
        cond.image_latents = self.encode_references(references, resolution)
        return cond

    # -- the transformer: noisy tokens, then the input image's ------------------------------------
    def _forward(self, transformer, x, t, side: TextSide, guidance_scale, dtype) -> torch.Tensor:
        if side.image is None:
            return super()._forward(transformer, x, t, side, guidance_scale, dtype)
        h, w = x.shape[-2:]
        rh, rw = side.image.shape[-2:]
        tokens = torch.cat([pack(x), pack(side.image.to(self.device, dtype))], dim=1)
        out = transformer(
            hidden_states=tokens,
            timestep=t / 1000,
            guidance=None,
            encoder_hidden_states_mask=None if side.mask is None else side.mask.to(self.device),
            encoder_hidden_states=side.embeds.to(self.device, dtype),
            img_shapes=[[(1, h // 2, w // 2), (1, rh // 2, rw // 2)]] * x.shape[0],
            return_dict=False,
        )[0]
        return out[:, : (h // 2) * (w // 2)]


class QwenImageEditV1Adapter(QwenImageEditAdapter):
    """Qwen-Image-Edit's first release (``QwenImageEditPipeline``): the Plus adapter with the VL encoder shown
    the input image at the VAE's size (see the module docstring)."""

    family = "qwen-image-edit-v1"
    pipeline_class = "QwenImageEditPipeline"
    builtin = TINY_QWEN_IMAGE_EDIT_V1_REF
    pipeline_logger = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit"

    @staticmethod
    def build_tiny():
        return build_tiny_qwen_image_edit_v1_pipeline()

    def condition_size(self, height: int, width: int, resolution: int) -> tuple[int, int]:
        """The VAE's size (``reference_size``): the pipeline resizes the input once and both encoders take it."""
        return self.reference_size(height, width, resolution)

    @torch.no_grad()
    def encode_conditioning(self, prompts: list[str], negative_prompt: str | None, max_sequence_length: int,
                            references: list[np.ndarray] | None = None, resolution: int | None = None) -> Conditioning:
        if references is None:
            from diffusionrl.config import ConfigError

            raise ConfigError(f"{self.pipeline_class} (Qwen-Image-Edit's first release, {self.family}) edits images "
                              "only: its prompt template holds the input picture's vision tokens. Give every prompt "
                              "row an 'image', or use a model that also generates from text (e.g. "
                              "builtin:tiny-qwen-image-edit, QwenImageEditPlusPipeline)")
        return super().encode_conditioning(prompts, negative_prompt, max_sequence_length, references, resolution)
