"""Model-family adapter for FLUX.1 Kontext (diffusers ``FluxKontextPipeline``): image editing.

Kontext is FLUX.1 (``models/flux.py``) whose transformer also sees the image to edit. What it adds,
as the stock pipeline does it:
- The prompt row's input image (``image``, ``data/images.py``) is resized (``reference_size``), VAE-encoded
  (the posterior's mode, shifted and scaled) and kept spatial in ``Conditioning.image_latents``
  ``[B, 16, h, w]``, so rollouts, log-prob recomputes and the trainer use the very same tensor
  (``encode_references``; the rollout engine calls it on the batch's row images).
- ``image_tokens``: its packed tokens are appended to the noisy latents' on the sequence axis, with
  their own position ids (the same row/column ids, first coordinate 1 instead of 0); the velocity is
  the output's first ``(H/2)(W/2)`` tokens (``FluxAdapter.velocity``).
- The schedule's shift counts the noisy latents' tokens only (``image_seq_len`` of ``PackedLatents``).
Without an input image (rows with no ``image``) it samples as FLUX.1, as the pipeline does with ``image=None``.

The reference's size: the input image's aspect at the sampling resolution's area, in whole 16-pixel
patches (the pipeline's ``max_area`` rule for the output, ``_auto_resize=False`` for the input, whose
preferred ~1 MP Kontext resolutions a small training resolution would dwarf). An image already at
that size is not resampled. One rollout's images must come out at one size (one aspect).
"""

from __future__ import annotations

import numpy as np
import torch

from .flux import FluxAdapter, image_ids
from .packed import pack
from .references import EditingReferences
from .textside import TextSide
from .tiny_flux import TINY_FLUX_KONTEXT_REF, build_tiny_flux_kontext_pipeline

__all__ = ["FluxKontextAdapter", "reference_ids"]


def reference_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Position ids of the input image's packed tokens: ``image_ids`` with the first coordinate 1."""
    ids = image_ids(h, w, device, dtype)
    ids[:, 0] = 1
    return ids


class FluxKontextAdapter(EditingReferences, FluxAdapter):
    """FLUX.1 Kontext behind the interface the engines and the trainer use."""

    family = "flux-kontext"
    pipeline_class = "FluxKontextPipeline"
    builtin = TINY_FLUX_KONTEXT_REF
    pipeline_logger = "diffusers.pipelines.flux.pipeline_flux_kontext"

    @staticmethod
    def build_tiny():
        return build_tiny_flux_kontext_pipeline()

    @classmethod
    def builtins(cls) -> dict:
        # builtin:tiny-flux-kontext-shapes: edits shapes-world scenes (models/tiny_flux_shapes.py, shipped weights)
        from .tiny_flux_shapes import KONTEXT_SHAPES_REF, build_kontext_shapes_pipeline

        return {**super().builtins(), KONTEXT_SHAPES_REF: build_kontext_shapes_pipeline}

    def reference_size(self, height: int, width: int, resolution: int) -> tuple[int, int]:
        """``(height, width)`` in pixels the input image is encoded at (see the module docstring)."""
        multiple = self.vae_scale_factor * 2
        aspect = width / height
        w = round((resolution * resolution * aspect) ** 0.5) // multiple * multiple
        h = round((resolution * resolution / aspect) ** 0.5) // multiple * multiple
        return max(h, multiple), max(w, multiple)

    def _encode_reference(self, image: np.ndarray, h: int, w: int) -> torch.Tensor:
        from PIL import Image

        vae, processor = self.pipe.vae, self.pipe.image_processor
        pil = processor.resize(Image.fromarray(np.ascontiguousarray(image)), h, w)
        z = vae.encode(processor.preprocess(pil, h, w).to(self.device, vae.dtype)).latent_dist.mode()
        return (z.float() - vae.config.shift_factor) * vae.config.scaling_factor

    def image_tokens(self, x: torch.Tensor, side: TextSide, dtype: torch.dtype) -> tuple:
        tokens, ids = super().image_tokens(x, side, dtype)
        ref = side.image
        if ref is None:
            return tokens, ids
        _, _, h, w = ref.shape
        ref_tokens = pack(ref.to(self.device, dtype))
        return torch.cat([tokens, ref_tokens], dim=1), torch.cat([ids, reference_ids(h, w, self.device, dtype)])
