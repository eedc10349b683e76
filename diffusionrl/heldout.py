"""Held-out probes during training and the reward-hacking alarm.

A rising training reward is not learning: a policy can raise it by gaming the reward (a picture
that pleases the judge whatever the prompt) or by collapsing onto one image. Two figures tell the
difference, and every image run computes both every ``eval.every`` steps:

- the **held-out score**: the run's reward on the held-out prompts (``eval.probe_prompts`` of them,
  one fixed seed each, repeated with further seeds up to a whole number of the engines' blocks, ODE
  sampling at the evaluation's steps and guidance), from the rollout engine's current weights; and
- the **diversity**: the mean distance between images of different prompts (``diversity``; a policy
  that draws one picture for every prompt has diversity near 0).

``HeldOutProbe`` (in ``training.backend.ImageBackend``) writes them into the step's metrics as
``heldout/reward_mean``, ``heldout/reward_std``, ``heldout/num_samples``, ``heldout/<reward>_mean`` and
``_std``, ``heldout/<reward>_<key>`` (a reward's per-sample values, e.g. geneval_mini's success),
``heldout/diversity`` (when there are two prompts) and ``heldout/policy_version`` (the updates the
probed weights have had). ``hacking_alarms`` reads a run's metric rows and flags each probe where
the training reward has risen above its first window's while the held-out score fell (below the
previous probe's or the first probe's by more than ``Z`` standard errors) or the diversity fell
below ``DIVERSITY_FLOOR`` of the first probe's. With two rewards or more, each reward's held-out mean
is watched as well: a second judge weighted 0 in ``reward.weights`` (say ``geneval_mini`` beside
``geneval_mini_rules``) is trained on by no one, so its fall while the trained reward holds is gaming.
``HackingAlarm`` (a ``Callback``) puts ``alarm/hacking`` (1 or 0) into every probed step's metrics and
logs one warning line naming the step and the reason; the report plots the same rows and marks the same
steps.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffusionrl.run import Callback

log = logging.getLogger(__name__)

TRAIN_KEY = "rollout/reward/raw_mean"
HELDOUT_KEY = "heldout/reward_mean"
DIVERSITY_KEY = "heldout/diversity"
ALARM_KEY = "alarm/hacking"
Z = 2.0  # standard errors a held-out drop must exceed to count
DIVERSITY_FLOOR = 0.5  # of the first probe's diversity


def diversity(images: np.ndarray, prompts: list[str], side: int = 32) -> float:
    """Mean absolute pixel distance (in [0, 1]) between the images of different prompts, each image
    resized to ``side`` x ``side`` (videos: their middle frame); nan when all prompts are one."""
    from PIL import Image

    images = np.asarray(images)
    if images.ndim == 5:
        images = images[:, images.shape[1] // 2]
    small = np.stack([np.asarray(Image.fromarray(im).resize((side, side), Image.BILINEAR), np.float32) / 255.0
                      for im in images]).reshape(len(images), -1)
    labels = np.asarray(prompts)
    total, pairs = 0.0, 0
    for i in range(len(small)):
        other = labels[i + 1:] != labels[i]
        if other.any():
            total += float(np.abs(small[i + 1:][other] - small[i]).mean(axis=1).sum())
            pairs += int(other.sum())
    return total / pairs if pairs else float("nan")


class HeldOutProbe:
    """The held-out score and diversity of the rollout engine's weights, every ``eval.every`` steps."""

    def __init__(self, cfg, test_rows: list[dict], scorer, spec):
        """``spec``: the evaluation's sampling (``evaluation.eval_spec``)."""
        n = cfg.eval.probe_prompts
        self.rows = test_rows if n == 0 else test_rows[:n]
        self.every = cfg.eval.every if self.rows else 0
        self.spec = spec
        self.scorer = scorer
        self.seed = cfg.eval.seed
        train_cfg = cfg.train  # a probe fills whole blocks as a rollout does (distributed.shards.assign_blocks)
        engines = train_cfg.rollout_engines if train_cfg.world_size > 1 else 1
        self.block = math.lcm(train_cfg.group_size, train_cfg.micro_batch_size) * engines

    def due(self, version: int) -> bool:
        """Whether the weights after ``version`` updates are probed (0: the base, then every ``every``)."""
        return bool(self.every) and version % self.every == 0

    def __call__(self, worker, version: int) -> dict[str, float]:
        import torch

        # the held-out prompts in turn up to a whole number of the engines' blocks (group size and
        # micro-batch, per engine), sample i with seed eval.seed + i: the first len(rows) are the
        # evaluation's samples
        n = -(-len(self.rows) // self.block) * self.block
        rows = [self.rows[i % len(self.rows)] for i in range(n)]
        prompts = [r["prompt"] for r in rows]
        metadata = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
        seeds = torch.arange(self.seed, self.seed + n, dtype=torch.int64)
        groups = torch.as_tensor([i % len(self.rows) for i in range(n)], dtype=torch.int64)
        traj = worker.generate(prompts, groups, seeds, self.spec, None, metadata)
        total, parts = self.scorer(traj.images, prompts, metadata)
        out = {HELDOUT_KEY: float(np.mean(total)), "heldout/reward_std": float(np.std(total)),
               "heldout/num_samples": float(n), "heldout/policy_version": float(version)}
        spread = diversity(traj.images, prompts)
        if np.isfinite(spread):  # one held-out prompt has no pair of different prompts
            out[DIVERSITY_KEY] = spread
        for name, result in parts.items():
            out[f"heldout/{name}_mean"] = float(np.mean(result.scores))
            out[f"heldout/{name}_std"] = float(np.std(result.scores))
            for key, values in result.per_sample.items():
                out[f"heldout/{name}_{key}"] = float(np.mean(values))
        return out


@dataclass
class Alarm:
    step: int  # the metrics row (training step) the probe was logged with
    policy_version: int
    reason: str


def _se(row: dict, key: str = HELDOUT_KEY) -> float:
    std = "heldout/reward_std" if key == HELDOUT_KEY else key[: -len("_mean")] + "_std"
    return float(row.get(std, 0.0)) / max(1.0, float(row.get("heldout/num_samples", 1.0))) ** 0.5


def _watched(row: dict) -> list[tuple[str, str]]:
    """(label, key) of the held-out figures a probe row holds: the weighted reward, and with two rewards
    or more each reward's own mean (one weighted 0 is only watched: a judge the policy is not trained on)."""
    parts = sorted(k for k in row if k.startswith("heldout/") and k.endswith("_mean") and k != HELDOUT_KEY
                   and k[: -len("_mean")] + "_std" in row)
    return [("held-out reward", HELDOUT_KEY),
            *((f"held-out {k[len('heldout/'):-len('_mean')]}", k) for k in parts if len(parts) > 1)]


def hacking_alarms(rows: list[dict[str, Any]]) -> list[Alarm]:
    """Every probe of ``rows`` (metric rows in step order) at which the training reward had risen
    above its first window's while the held-out score fell or the diversity collapsed."""
    probes = [i for i, r in enumerate(rows) if HELDOUT_KEY in r]
    if not probes:
        return []
    first = rows[probes[0]]
    window = max(1, probes[1] - probes[0]) if len(probes) > 1 else len(rows)

    def train_mean(lo: int, hi: int) -> float:  # the training reward of rows[lo:hi]
        values = [float(r[TRAIN_KEY]) for r in rows[max(0, lo):hi] if TRAIN_KEY in r]
        return float(np.mean(values)) if values else float("nan")

    train_first = train_mean(probes[0], probes[0] + window)
    alarms = []
    for prev, k in zip(probes, probes[1:]):
        row, before = rows[k], rows[prev]
        recent = train_mean(k - window + 1, k + 1)  # the rollouts of the last window, this probe's included
        if not recent > train_first:
            continue  # the training reward is not rising: nothing to be fooled by
        version = int(row.get("heldout/policy_version", row.get("step", k)))
        reasons = []
        for what, key in _watched(row):
            score = float(row[key])
            for label, ref in (("the previous probe", before), ("the first probe", first)):
                if key not in ref:
                    continue
                drop = float(ref[key]) - score
                if drop > Z * (_se(row, key) ** 2 + _se(ref, key) ** 2) ** 0.5 and drop > 0:
                    reasons.append(f"{what} fell to {score:.4g} from {float(ref[key]):.4g} at "
                                   f"{label} (version {int(ref.get('heldout/policy_version', 0))})")
                    break
        d0, d = float(first.get(DIVERSITY_KEY, np.nan)), float(row.get(DIVERSITY_KEY, np.nan))
        if np.isfinite(d0) and np.isfinite(d) and d < DIVERSITY_FLOOR * d0:
            reasons.append(f"diversity collapsed to {d:.3g} (first probe {d0:.3g})")
        if reasons:
            alarms.append(Alarm(int(row.get("step", k + 1)), version,
                                f"training reward rose ({recent:.4g} vs {train_first:.4g} at the start) "
                                f"while the " + "; ".join(reasons)))
    return alarms


class HackingAlarm(Callback):
    """``alarm/hacking`` in every probed step's metrics, and one warning line when it goes off."""

    def on_metrics(self, loop, step: int, metrics: dict[str, float]) -> None:
        if HELDOUT_KEY not in metrics:
            return
        alarms = [a for a in hacking_alarms(loop.history) if a.step == int(metrics.get("step", step))]
        metrics[ALARM_KEY] = float(bool(alarms))
        for alarm in alarms:
            log.warning("reward-hacking alarm at step %d (policy version %d): %s", alarm.step,
                        alarm.policy_version, alarm.reason)
