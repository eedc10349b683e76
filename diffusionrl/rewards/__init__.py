"""Rewards: a registry with one signature, ``(images, prompts, metadata) -> RewardResult``.

``base`` is the contract (``Reward``, ``RewardResult``, ``register_reward``), ``registry`` the
lookup by name, ``mixture`` the weighted sum, ``pool`` the Ray CPU actors, ``factory`` what a
``reward`` config section asks for (``make_scorer``, ``prompt_validator``). Importing the package
does not import torch.
"""

from .base import Reward, RewardResult, register_reward, reward_threads, safe_score, set_reward_threads
from .factory import make_scorer, prompt_validator
from .mixture import MixtureReward, reward_metrics
from .registry import available_rewards, build_reward, prompt_check

__all__ = [
    "MixtureReward",
    "Reward",
    "RewardResult",
    "available_rewards",
    "build_reward",
    "make_scorer",
    "prompt_check",
    "prompt_validator",
    "register_reward",
    "reward_metrics",
    "reward_threads",
    "safe_score",
    "set_reward_threads",
]
