"""What a ``reward`` config section asks for: the scorer of generated images and the prompt check.

Neither names a reward: both go through the registry, so a new reward needs no change here.
"""

from __future__ import annotations

from collections.abc import Callable

from .mixture import MixtureReward
from .registry import prompt_check


def make_scorer(reward_cfg):
    """The scorer the training loop calls: ``scorer(images, prompts, metadata) -> (total, parts)``.

    In-process ``MixtureReward`` when ``reward_cfg.num_actors == 0``, else a pool of Ray CPU actors
    with the same call signature (``diffusionrl.rewards.pool.RewardActorPool``).
    """
    if reward_cfg.num_actors > 0:
        from .pool import RewardActorPool

        return RewardActorPool(reward_cfg)
    return MixtureReward(reward_cfg.weights, reward_cfg)


def prompt_validator(reward_cfg) -> Callable[[list[dict], str], None] | None:
    """Extra prompt checks the configured rewards need (e.g. OCR needs a quoted target).

    Returns ``validate(rows, where, locations=None)`` for ``data.load_prompts(..., validate=...)``:
    it runs the ``validate_prompts`` of every reward in ``reward_cfg.weights`` (in that order) on the
    rows' prompts, with the rows as metadata, ``where`` as the source and ``locations`` (each row's
    file and line, when the rows come from files), and raises the first one's ``ValueError``. None
    when no configured reward checks prompts. Builds no reward (no model is loaded, torch is not
    imported). A name that is not registered is a ``ConfigError`` here already, before any model is
    loaded (``load_prompts`` runs first).
    """
    checks = [check for name in reward_cfg.weights if (check := prompt_check(name)) is not None]
    if not checks:
        return None

    def validate(rows: list[dict], where: str, locations: list[str] | None = None) -> None:
        prompts = [r["prompt"] for r in rows]
        for check in checks:
            check(prompts, [r for r in rows], source=where, locations=locations)

    return validate
