"""Looking up registered rewards by name; the built-in ones (jpeg, geneval_mini, shape_edit, ocr,
pickscore, video) register on first use."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diffusionrl.config import ConfigError

from .base import _REGISTRY, Reward, validates_prompts

# modules of this package that register rewards
BUILTIN = ("jpeg", "geneval_mini", "shape_edit", "ocr", "pickscore", "video")
OPTIONAL = ("ocr", "pickscore")  # skipped when a dependency they need at import is missing


def _load_builtin() -> None:
    # Importing the modules registers their rewards; optional heavy ones import lazily inside.
    for module in BUILTIN:
        try:
            __import__(f"{__package__}.{module}")
        except ModuleNotFoundError as exc:  # module not written yet / optional extra missing
            if module in OPTIONAL and exc.name and exc.name.endswith(module):
                continue
            raise


def available_rewards() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def reward_type(name: str) -> Callable[..., Reward]:
    """What is registered under ``name``: a reward class or a factory function."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError(f"reward.weights names an unknown reward {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def build_reward(name: str, reward_cfg) -> Reward:
    registered = reward_type(name)
    return getattr(registered, "from_config", registered)(reward_cfg)


def prompt_check(name: str) -> Callable[[Sequence[str], Sequence[dict] | None, str], None] | None:
    """``check(prompts, metadata, source)`` of reward ``name`` (raises on a data error), or None if
    the reward checks no prompts. Nothing is built: the check is the reward's ``validate_prompts``."""
    registered = reward_type(name)
    return registered.validate_prompts if validates_prompts(registered) else None
