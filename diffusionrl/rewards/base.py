"""The reward contract: every reward has one signature, ``(images, prompts, metadata) -> RewardResult``.

``images`` is a uint8 array ``[B, H, W, 3]`` (a reward with ``video = True`` gets videos
``[B, F, H, W, 3]``; image rewards see a video's frames one by one, ``rewards/video.py``),
``prompts`` a list of B strings, ``metadata`` a list
of B dicts (dataset fields such as an OCR target). A reward never raises for one bad sample: it
scores it 0 and counts it in ``failures``. A prompt the reward can never score (a data error) is
reported by its ``validate_prompts``, before any image is made.

This module knows no reward by name and imports none: rewards import it and register themselves
with ``@register_reward(name)``; ``registry`` looks them up, ``mixture`` sums them, ``pool`` scores
them on Ray actors and ``factory`` builds the scorer and the prompt check a config asks for.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

# Intra-op threads a reward's own thread pools may use in this process (0 or unset: the library's
# default). The actor pool sets it in each actor before building its rewards; see set_reward_threads.
THREADS_ENV = "DIFFUSIONRL_REWARD_THREADS"


@dataclass
class RewardResult:
    scores: np.ndarray  # [B] float32
    failures: int = 0  # samples that could not be scored and got 0
    info: dict[str, float] = field(default_factory=dict)  # extra per-batch statistics to log
    # extra per-sample values ([B] arrays, e.g. geneval_mini's success): the evaluation table's columns
    per_sample: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)


class Reward:
    """Base class of the rewards: subclass it, set ``name``, define ``__call__`` and register the class.

    ``from_config`` builds the reward from the ``reward`` config section (default ``cls(reward_cfg)``);
    ``validate_prompts`` checks prompts without building anything (default: every prompt is fine);
    ``close`` frees what the reward holds. A plain callable with a ``name`` works wherever a built
    reward is expected (``MixtureReward(rewards=...)``).
    """

    name: str = "reward"

    @classmethod
    def from_config(cls, reward_cfg) -> Reward:
        return cls(reward_cfg)

    @classmethod
    def validate_prompts(cls, prompts: Sequence[str], metadata: Sequence[dict] | None = None,
                         source: str = "prompts", locations: Sequence[str] | None = None) -> None:
        """Raise ``ValueError`` naming ``source`` and the first row this reward cannot score.

        ``source`` says where the rows come from (a file path, "ocr reward batch") for the message;
        ``locations[i]``, when given, names row i's file and line (``path:line``): name that one.
        """

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> RewardResult:
        """Score a batch; one sample that cannot be scored gets 0 and is counted, it never raises.

        Args:
            images (`np.ndarray`): uint8 RGB ``[B, H, W, 3]`` (videos ``[B, F, H, W, 3]`` for a reward with
                ``video = True``).
            prompts (`list[str]`): the B prompts the images were made for.
            metadata (`list[dict]`): the B prompt rows' other fields (an OCR target, a shapes scene).

        Returns:
            `RewardResult`: ``scores`` ``[B]`` float32, ``failures``, batch ``info`` and ``per_sample`` values.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define __call__")

    def close(self) -> None:
        """Free models, sessions or processes the reward holds (default: nothing to free)."""


def validates_prompts(reward_type) -> bool:
    """True if ``reward_type`` defines its own ``validate_prompts`` (not the contract's no-op)."""
    method = getattr(reward_type, "validate_prompts", None)
    return method is not None and getattr(method, "__func__", method) is not Reward.validate_prompts.__func__


_REGISTRY: dict[str, Callable[..., Reward]] = {}


def register_reward(name: str):
    """Class/function decorator registering a reward under ``name``.

    A class is built with ``cls.from_config(reward_cfg)`` (a ``Reward`` subclass inherits one) and
    checks prompts with its ``validate_prompts`` (``Reward.validate_prompts``'s parameters, ``locations``
    included: a ``TypeError`` here otherwise); a function is a factory ``factory(reward_cfg) -> Reward``
    whose rewards check no prompts.
    """

    def wrap(factory):
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is registered twice")
        if validates_prompts(factory) and "locations" not in inspect.signature(factory.validate_prompts).parameters:
            raise TypeError(f"reward {name!r}: {factory.__name__}.validate_prompts takes no locations; give it "
                            "Reward.validate_prompts's parameters (prompts, metadata=None, source, locations=None)")
        _REGISTRY[name] = factory
        return factory

    return wrap


def set_reward_threads(threads: int) -> None:
    """Cap the intra-op threads of the rewards built after this call in this process.

    Sets ``$DIFFUSIONRL_REWARD_THREADS`` (read by ``reward_threads()``, e.g. for onnxruntime) and
    ``OMP_NUM_THREADS`` (read by torch when it starts): call it before any reward is built.
    """
    os.environ[THREADS_ENV] = str(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def reward_threads() -> int:
    """The thread cap ``set_reward_threads`` set for this process; 0 when none was set."""
    return max(0, int(os.environ.get(THREADS_ENV, "0") or 0))


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
        except Exception as exc:  # a reward failure must not stop training
            failures += 1
            log.warning("reward %s failed on sample %d (%s): %s", name, i, prompt[:60], exc)
    return RewardResult(scores, failures)
