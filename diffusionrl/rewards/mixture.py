"""The weighted sum of registered rewards, and the metrics of one scored batch."""

from __future__ import annotations

import numpy as np

from .base import Reward, RewardResult
from .registry import build_reward
from .video import score_samples


class MixtureReward:
    """Weighted sum of registered rewards; every component is reported as well. On videos
    ``[B, F, H, W, 3]`` an image reward scores each frame and averages (``rewards/video.py``)."""

    def __init__(self, weights: dict[str, float], reward_cfg, rewards: dict[str, Reward] | None = None):
        self.weights = dict(weights)
        self.rewards = rewards or {name: build_reward(name, reward_cfg) for name in self.weights}
        self.name = "+".join(f"{w:g}*{n}" for n, w in self.weights.items())

    def __call__(self, images, prompts, metadata) -> tuple[np.ndarray, dict[str, RewardResult]]:
        total = np.zeros(len(prompts), dtype=np.float32)
        parts: dict[str, RewardResult] = {}
        for name, weight in self.weights.items():
            result = score_samples(self.rewards[name], images, prompts, metadata)
            parts[name] = result
            total += np.float32(weight) * result.scores
        return total, parts

    def close(self) -> None:
        for reward in self.rewards.values():
            close = getattr(reward, "close", None)
            if close:
                close()


def reward_metrics(total: np.ndarray, parts: dict[str, RewardResult],
                   prefix: str = "rollout/reward") -> dict[str, float]:
    """The docs/algorithms.md section-10 reward metrics of one batch."""
    out = {
        f"{prefix}/raw_mean": float(np.mean(total)),
        f"{prefix}/raw_std": float(np.std(total)),
        f"{prefix}/raw_min": float(np.min(total)),
        f"{prefix}/raw_max": float(np.max(total)),
        f"{prefix}/raw_median": float(np.median(total)),
        f"{prefix}/num_samples": float(len(total)),
    }
    for name, result in parts.items():
        out[f"{prefix}/{name}_mean"] = float(np.mean(result.scores))
        out[f"{prefix}/{name}_failures"] = float(result.failures)
        for key, value in result.info.items():
            out[f"{prefix}/{name}_{key}"] = float(value)
    return out
