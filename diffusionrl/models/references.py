"""The input images of an editing rollout (FLUX.1 Kontext, Qwen-Image-Edit): what both families' ``encode_references``
share. The batch's images come out at one size, and each distinct image is encoded once and alone, so its latents do
not depend on the batch it came in."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def image_key(image: np.ndarray) -> bytes:
    """A key that tells distinct input images apart (their bytes and shape)."""
    return image.tobytes() + str(image.shape).encode()


def encode_each_once(images: list[np.ndarray], resolution: int, size: Callable[[int, int], tuple[int, int]],
                     encode: Callable[[np.ndarray, int, int], torch.Tensor]) -> torch.Tensor:
    """RGB uint8 ``images`` -> their latents ``[B, C, h, w]``: ``size(height, width)`` is the ``(h, w)`` in pixels
    an image is encoded at for ``resolution`` (one for the whole batch, else a ValueError), ``encode(image, h, w)``
    the family's encoding of one image, ``[1, C, h', w']``."""
    sizes = {size(im.shape[0], im.shape[1]) for im in images}
    if len(sizes) > 1:
        raise ValueError(f"the input images of one rollout come out at {len(sizes)} sizes {sorted(sizes)} at "
                         f"resolution {resolution}; give the images of an editing dataset one aspect ratio")
    (h, w), = sizes
    encoded: dict[bytes, torch.Tensor] = {}
    for im in images:
        key = image_key(im)
        if key not in encoded:
            encoded[key] = encode(im, h, w)
    return torch.cat([encoded[image_key(im)] for im in images])


class EditingReferences:
    """The editing families' ``encode_references`` (``FlowAdapter.encode_conditioning`` calls it): each family
    gives ``reference_size`` (the pixel size an input image is encoded at) and ``_encode_reference`` (its
    pipeline's encoding of one image)."""

    editing = True

    def reference_size(self, height: int, width: int, resolution: int) -> tuple[int, int]:
        raise NotImplementedError

    def _encode_reference(self, image: np.ndarray, h: int, w: int) -> torch.Tensor:
        """One input image at ``h x w`` pixels -> its latents ``[1, C, h', w']`` float32, the pipeline's steps."""
        raise NotImplementedError

    @torch.no_grad()
    def encode_references(self, images: list[np.ndarray], resolution: int) -> torch.Tensor:
        """RGB uint8 input images -> their latents ``[B, C, h', w']`` float32 on the adapter's device
        (``encode_each_once``)."""
        return encode_each_once(images, resolution, lambda h, w: self.reference_size(h, w, resolution),
                                self._encode_reference)
