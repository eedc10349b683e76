"""Does SFT lower the flow-matching loss on pairs it never trained on? The ``tiny-cpu-sft`` preset.

Trains on ``algorithm.sft_source`` (default ``builtin:shapes:256``, drawn with ``data.seed``) and
scores ``--held-out`` other pictures (``builtin:shapes`` drawn with ``data.seed + 1``) with
``SFTObjective.held_out_loss`` (the same ``t`` and ``eps`` before and after) before the first step
and after the last. Prints one JSON line: {"held_out_loss_before", "held_out_loss_after",
"relative_drop", "train_loss_first", "train_loss_last", "steps", "wall_s"}.

    python bench/sft.py [--steps N] [--budget-s S] [--held-out N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _common  # sets sys.path and offline env

from diffusionrl.config import load_config
from diffusionrl.data import shape_pairs
from diffusionrl.train import build_loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--budget-s", type=float, default=None, help="stop after the step that spends this wall time")
    ap.add_argument("--held-out", type=int, default=64, help="held-out pictures scored before and after")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    cfg = load_config("tiny-cpu-sft", overrides=[f"train.steps={args.steps}", "train.checkpoint_every=0",
                                                 *args.overrides])
    with tempfile.TemporaryDirectory() as tmp:
        loop = build_loop(cfg, tmp, progress=False)
        objective = loop.backend.worker.objective
        held = loop.backend.encode(shape_pairs(args.held_out, cfg.sampling.resolution, cfg.data.seed + 1))
        before = objective.held_out_loss(held)
        losses = []
        t0 = time.perf_counter()
        while loop.step < cfg.train.steps and not (args.budget_s and time.perf_counter() - t0 >= args.budget_s):
            metrics = loop.run_step(loop.step)
            losses.append(metrics["train/loss"])
        wall = time.perf_counter() - t0
        after = objective.held_out_loss(held)
        loop.close()
    _common.emit({"held_out_loss_before": before, "held_out_loss_after": after,
                      "relative_drop": (before - after) / before, "train_loss_first": losses[0],
                      "train_loss_last": losses[-1], "steps": len(losses), "wall_s": round(wall, 1)})


if __name__ == "__main__":
    main()
