"""Rewards on videos: image rewards per frame (averaged over a video's frames), and the temporal
consistency of a video.

``score_samples`` is how ``MixtureReward`` calls every reward: image batches ``[B, H, W, 3]`` go
to the reward as they are; video batches ``[B, F, H, W, 3]`` go whole to a reward that declares
``video = True`` and frame by frame (``B*F`` images, each with its video's prompt and metadata)
to an image reward, whose scores are then averaged over each video's frames.
"""

from __future__ import annotations

import numpy as np

from .base import Reward, RewardResult, register_reward


def score_samples(reward, samples: np.ndarray, prompts: list[str], metadata: list[dict]) -> RewardResult:
    """``reward`` on images, or on videos (whole for a video reward, else per frame, averaged)."""
    samples = np.asarray(samples)
    if samples.ndim != 5 or getattr(reward, "video", False):
        return reward(samples, prompts, metadata)
    b, f = samples.shape[:2]
    frames = samples.reshape(b * f, *samples.shape[2:])
    result = reward(frames, [p for p in prompts for _ in range(f)], [m for m in metadata for _ in range(f)])
    info = dict(result.info)
    info["frames_per_sample"] = float(f)
    return RewardResult(result.scores.reshape(b, f).mean(axis=1), result.failures, info)


def frame_difference(video: np.ndarray) -> float:
    """Mean absolute change between consecutive frames of a uint8 ``[F, H, W, 3]`` video, in [0, 1]."""
    v = np.asarray(video)
    if v.ndim != 4 or v.shape[-1] != 3 or v.dtype != np.uint8:
        raise ValueError(f"expected a uint8 video [F, H, W, 3], got {v.dtype} {v.shape}")
    if v.shape[0] < 2:
        return 0.0
    return float(np.abs(np.diff(v.astype(np.float32), axis=0)).mean() / 255.0)


class TemporalConsistencyReward(Reward):
    """``-mean |frame_{k+1} - frame_k| / 255``: 0 for a still video, lower the more it flickers."""

    name = "temporal_consistency"
    video = True

    def __init__(self, reward_cfg=None):
        pass

    def __call__(self, images, prompts, metadata) -> RewardResult:
        images = np.asarray(images)
        if images.ndim != 5:
            raise ValueError(f"temporal_consistency scores videos [B, F, H, W, 3]; got shape {images.shape} (an "
                             "image model: drop it from reward.weights)")
        return RewardResult(np.array([-frame_difference(v) for v in images], dtype=np.float32))


register_reward("temporal_consistency")(TemporalConsistencyReward)
