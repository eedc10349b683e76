"""MixGRPO against Flow-GRPO on the tiny JPEG task: time per RL step and the reward it reaches.

Variants (each ``tiny-cpu``'s model, data, batch and learning rate, jpeg_compressibility):
- ``flow_grpo_all``: Flow-GRPO with every step but the last stochastic and trained (``step_strategy=all``);
- ``flow_grpo_fast``: the ``tiny-cpu`` preset (a 2-step SDE window at a random place in [0, 5) per group);
- ``mixgrpo``: the ``tiny-cpu-mixgrpo`` preset (one 2-step window for all groups, sliding);
- ``mixgrpo_flash``: the same with DPM-Solver++(2M) ODE steps outside the window;
- ``mixgrpo_compressed`` / ``mixgrpo_flash_compressed``: ``mixgrpo`` / ``mixgrpo_flash`` with MixGRPO-Flash's
  time-step compression, the ODE steps after the window taken as ``sampling.post_window_ode_steps=2`` larger
  ones (of the 8 after the window at its first position; the official Flash script's ratio 0.4 gives as many).

The variants' steps are interleaved (step k of each, in turn), so the machine's drift falls on all
of them alike. Prints per variant the median step, rollout and update seconds, the total wall
time, the first step's mean reward, the last 3 steps' and their gain in first-step stds; and under
``ratios`` each compressed variant's median rollout and step time over its uncompressed twin's (where
both ran).

    python bench/mixgrpo.py [--steps 12] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _common  # sets sys.path and offline env
import numpy as np

from diffusionrl.config import load_config
from diffusionrl.train import build_loop

VARIANTS = {
    "flow_grpo_all": ("tiny-cpu", ["sampling.step_strategy=all"]),
    "flow_grpo_fast": ("tiny-cpu", []),
    "mixgrpo": ("tiny-cpu-mixgrpo", []),
    "mixgrpo_flash": ("tiny-cpu-mixgrpo", ["sampling.ode_solver=dpm2m"]),
    "mixgrpo_compressed": ("tiny-cpu-mixgrpo", ["sampling.post_window_ode_steps=2"]),
    "mixgrpo_flash_compressed": ("tiny-cpu-mixgrpo", ["sampling.ode_solver=dpm2m", "sampling.post_window_ode_steps=2"]),
}
COMPRESSED = {"mixgrpo_compressed": "mixgrpo", "mixgrpo_flash_compressed": "mixgrpo_flash"}  # variant -> its twin
COMMON = ["reward.weights={jpeg_compressibility: 1.0}", "train.checkpoint_every=0", "train.log_images_every=0",
          "eval.every=0"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        loops = {}
        for name in names:
            preset, extra = VARIANTS[name]
            cfg = load_config(preset, overrides=COMMON + extra + [f"train.steps={args.steps}"] + args.overrides)
            loops[name] = build_loop(cfg, f"{tmp}/{name}", progress=False)
            loops[name].backend.push_weights(0)
        wall = dict.fromkeys(names, 0.0)
        for step in range(args.steps):
            for name in names:
                t0 = time.perf_counter()
                loops[name].run_step(step)
                wall[name] += time.perf_counter() - t0
        out = {}
        for name in names:
            hist = loops[name].history
            rewards = [m["rollout/reward/raw_mean"] for m in hist]
            std0 = hist[0]["rollout/reward/raw_std"]
            out[name] = {
                **{f"{k}_s": round(float(np.median([m[f"perf/{k}_time"] for m in hist])), 3)
                   for k in ("step", "rollout", "train")},
                "wall_s": round(wall[name], 1),
                "reward_first": rewards[0],
                "reward_last3": float(np.mean(rewards[-3:])),
                "gain_in_std": (float(np.mean(rewards[-3:])) - rewards[0]) / std0 if std0 > 0 else float("nan"),
            }
            loops[name].close()
    ratios = {f"{name}/{twin}": {k: round(out[name][f"{k}_s"] / out[twin][f"{k}_s"], 3) for k in ("rollout", "step")}
              for name, twin in COMPRESSED.items() if name in out and twin in out}
    _common.emit({**out, **({"ratios": ratios} if ratios else {})})


if __name__ == "__main__":
    main()
