"""JPEG (in)compressibility rewards: the size of the image saved at JPEG quality 95."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from .base import Reward, RewardResult, register_reward, safe_score


def jpeg_size_kb(image: np.ndarray, quality: int = 95) -> float:
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 [H, W, 3] image, got {image.dtype} {image.shape}")
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


class JpegReward(Reward):
    def __init__(self, sign: float, name: str):
        self.sign = sign
        self.name = name

    def __call__(self, images, prompts, metadata) -> RewardResult:
        return safe_score(lambda im, _p, _m: self.sign * jpeg_size_kb(im) / 500.0, images, prompts, metadata, self.name)


@register_reward("jpeg_compressibility")
def _compressibility(reward_cfg=None) -> JpegReward:
    """-(JPEG quality-95 size in kB) / 500: smaller files score higher."""
    return JpegReward(-1.0, "jpeg_compressibility")


@register_reward("jpeg_incompressibility")
def _incompressibility(reward_cfg=None) -> JpegReward:
    """+(JPEG quality-95 size in kB) / 500: larger files score higher."""
    return JpegReward(1.0, "jpeg_incompressibility")
