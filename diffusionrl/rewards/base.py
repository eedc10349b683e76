"""Reward registry: every reward has one signature, ``(images, prompts, metadata) -> RewardResult``.

``images`` is a uint8 array ``[B, H, W, 3]``, ``prompts`` a list of B strings, ``metadata`` a list
of B dicts (dataset fields such as an OCR target). A reward never raises for one bad sample: it
scores it 0 and counts it in ``failures``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    scores: np.ndarray  # [B] float32
    failures: int = 0  # samples that could not be scored and got 0
    info: dict[str, float] = field(default_factory=dict)  # extra per-batch statistics to log

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)


class Reward(Protocol):
    name: str

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> RewardResult: ...


_REGISTRY: dict[str, Callable[..., Reward]] = {}


def register_reward(name: str):
    """Class/function decorator: ``factory(reward_cfg) -> Reward`` under ``name``."""

    def wrap(factory):
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_rewards() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build_reward(name: str, reward_cfg) -> Reward:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](reward_cfg)


def _load_builtin() -> None:
    # Importing the modules registers their rewards; optional heavy ones import lazily inside.
    from . import jpeg  # noqa: F401

    for optional in ("ocr", "pickscore"):
        try:
            __import__(f"{__package__}.{optional}")
        except ModuleNotFoundError as exc:  # module not written yet / optional extra missing
            if exc.name and exc.name.endswith(optional):
                continue
            raise


def safe_score(fn: Callable[[np.ndarray, str, dict], float], images, prompts, metadata, name: str) -> RewardResult:
    """Score sample by sample; an exception scores 0 and is counted, never raised."""
    scores = np.zeros(len(prompts), dtype=np.float32)
    failures = 0
    for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata)):
        try:
            value = float(fn(image, prompt, meta))
            if not np.isfinite(value):
                raise ValueError(f"non-finite score {value}")
            scores[i] = value
        except Exception as exc:  # noqa: BLE001 - a reward failure must not stop training
            failures += 1
            log.warning("reward %s failed on sample %d (%s): %s", name, i, prompt[:60], exc)
    return RewardResult(scores, failures)


class MixtureReward:
    """Weighted sum of registered rewards; every component is reported as well."""

    def __init__(self, weights: dict[str, float], reward_cfg, rewards: dict[str, Reward] | None = None):
        self.weights = dict(weights)
        self.rewards = rewards or {name: build_reward(name, reward_cfg) for name in self.weights}
        self.name = "+".join(f"{w:g}*{n}" for n, w in self.weights.items())

    def __call__(self, images, prompts, metadata) -> tuple[np.ndarray, dict[str, RewardResult]]:
        total = np.zeros(len(prompts), dtype=np.float32)
        parts: dict[str, RewardResult] = {}
        for name, weight in self.weights.items():
            result = self.rewards[name](images, prompts, metadata)
            parts[name] = result
            total += np.float32(weight) * result.scores
        return total, parts

    def close(self) -> None:
        for reward in self.rewards.values():
            close = getattr(reward, "close", None)
            if close:
                close()


def reward_metrics(total: np.ndarray, parts: dict[str, RewardResult], prefix: str = "rollout/reward") -> dict[str, float]:
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


def make_scorer(reward_cfg):
    """The scorer the training loop calls: ``scorer(images, prompts, metadata) -> (total, parts)``.

    In-process ``MixtureReward`` when ``reward_cfg.num_actors == 0``, else a pool of Ray CPU actors
    with the same call signature (``diffusionrl.rewards.pool.RewardActorPool``).
    """
    if reward_cfg.num_actors > 0:
        from .pool import RewardActorPool

        return RewardActorPool(reward_cfg)
    return MixtureReward(reward_cfg.weights, reward_cfg)
