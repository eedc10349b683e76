"""Rewards: a registry with one signature, ``(images, prompts, metadata) -> RewardResult``."""

from .base import (
    MixtureReward,
    Reward,
    RewardResult,
    available_rewards,
    build_reward,
    make_scorer,
    register_reward,
    reward_metrics,
    safe_score,
)

__all__ = [
    "MixtureReward",
    "Reward",
    "RewardResult",
    "available_rewards",
    "build_reward",
    "make_scorer",
    "register_reward",
    "reward_metrics",
    "safe_score",
]
