"""Does the default recipe learn? The ``tiny-cpu`` preset on ``jpeg_compressibility``.

Prints {"reward_first": ..., "reward_last3": ..., "gain_in_std": ..., "wall_s": ...}: the mean
reward of the first step and of the last 3 steps, their difference in units of the first step's
reward std, and the wall time. With ``--compare flow_grpo,nft`` each algorithm runs under the same
wall-time budget (``--budget-s``) with its own preset (``tiny-cpu-<name>``, ``tiny-cpu`` for
flow_grpo; ``dance`` is Flow-GRPO on ``tiny-cpu-dance``, ``mixgrpo`` on ``tiny-cpu-mixgrpo``) and the result is
{"flow_grpo": {...}, "nft": {...}}. Each result also has the median step, rollout and update times
(``step_s``, ``rollout_s``, ``train_s``).

    python bench/learning.py [--steps N] [--budget-s S] [--compare flow_grpo,grpo_guard,dppo,awm,dpo,nft]
                             [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _common  # sets sys.path and offline env
import numpy as np

from diffusionrl.config import ALGORITHMS, PRESETS, load_config
from diffusionrl.train import build_loop


class Budget:
    """Stops the loop (after the current step) once the wall-time budget is spent."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.perf_counter()

    def exceeded(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start >= self.seconds


def preset_for(name: str | None) -> str:
    """The preset a compared name runs with: ``tiny-cpu-<name>`` where there is one, else ``tiny-cpu``."""
    preset = f"tiny-cpu-{(name or '').replace('_', '-')}"
    return preset if preset in PRESETS else "tiny-cpu"


def run(algorithm: str | None, steps: int | None, budget_s: float | None, overrides: list[str],
        preset: str | None = None) -> dict:
    """One learning run: ``preset`` (default: ``preset_for(algorithm)``) on jpeg_compressibility."""
    extra = ["reward.weights={jpeg_compressibility: 1.0}", "train.checkpoint_every=0", "train.log_images_every=0"]
    if algorithm in ALGORITHMS:
        extra.append(f"algorithm.name={algorithm}")
    elif algorithm and preset_for(algorithm) == "tiny-cpu":
        raise SystemExit(f"--compare: {algorithm!r} is neither an algorithm ({', '.join(ALGORITHMS)}) nor a preset")
    if steps:
        extra.append(f"train.steps={steps}")
    cfg = load_config(preset or preset_for(algorithm), overrides=extra + overrides)
    budget = Budget(budget_s)
    with tempfile.TemporaryDirectory() as tmp:
        loop = build_loop(cfg, tmp, progress=False)
        loop.backend.push_weights(0)
        t0 = time.perf_counter()
        while loop.step < cfg.train.steps and not budget.exceeded():
            loop.run_step(loop.step)
        wall = time.perf_counter() - t0
        loop.close()
    rewards = [m["rollout/reward/raw_mean"] for m in loop.history]
    std0 = loop.history[0]["rollout/reward/raw_std"]
    last3 = float(np.mean(rewards[-3:]))
    return {
        "reward_first": rewards[0],
        "reward_last3": last3,
        "gain_in_std": (last3 - rewards[0]) / std0 if std0 > 0 else float("nan"),
        "wall_s": round(wall, 1),
        "steps": len(rewards),
        # medians over the steps: the whole step, its rollout and its update (s)
        **{f"{k}_s": round(float(np.median([m[f"perf/{k}_time"] for m in loop.history])), 3)
           for k in ("step", "rollout", "train")},
        "rewards": [round(r, 6) for r in rewards],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's train.steps")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-time budget per algorithm")
    ap.add_argument("--compare", default=None, help="comma-separated algorithms, e.g. flow_grpo,grpo_guard,dppo,"
                    "awm,dpo,nft (or dance)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.compare:
        budget = args.budget_s if args.budget_s is not None else 240.0
        _common.emit({a: run(a, args.steps, budget, args.overrides) for a in args.compare.split(",")})
    else:
        _common.emit(run(None, args.steps, args.budget_s, args.overrides))


if __name__ == "__main__":
    main()
