"""Exactness of the trainer on the tiny model, fp32.

Prints {"log_prob_mean_abs_diff": ..., "grad_split_max_rel_diff": ...}:
- the mean |rollout log-prob - trainer recompute| over every trained pair of one rollout, before
  any update (expected 0: same batch composition, same dtype, same sigmas);
- the max over LoRA tensors of |g_1 - g_4| / |g_1| between the LoRA gradient accumulated in
  1 micro-batch and in 4 micro-batches of the same rollout.

    python bench/exactness.py [--set key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import _common  # sets sys.path and offline env
import numpy as np
import torch

from diffusionrl.config import load_config
from diffusionrl.run import RunLoop
from diffusionrl.train import build_loop
from diffusionrl.training.trainer import UpdateStats


def grads(loop: RunLoop, traj, active, micro: int) -> dict[str, torch.Tensor]:
    traj = dataclasses.replace(traj, micro_batch_size=micro)
    loop.backend.worker.trainer.optimizer.zero_grad(set_to_none=True)
    units = loop.backend.worker.objective.units(traj, traj.micro_batches(), active, np.random.default_rng(0))
    assert loop.backend.worker.trainer.accumulate(units, UpdateStats())
    out = {n: p.grad.detach().clone() for n, p in loop.backend.worker.policy.params.items()}
    loop.backend.worker.trainer.optimizer.zero_grad(set_to_none=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    # 16 samples so that a 4-way split is possible; the rollout uses the full batch.
    cfg = load_config("tiny-cpu", overrides=["train.prompts_per_step=2", "train.group_size=8",
                                             "train.micro_batch_size=16", *args.overrides])
    with tempfile.TemporaryDirectory() as tmp:
        loop = build_loop(cfg, tmp, progress=False)
        loop.backend.push_weights(0)
        traj, active, _ = loop.backend.score(loop.backend.rollout(0))
        diff, pairs = loop.backend.worker.objective.recompute_log_prob_diff(traj)
        g1 = grads(loop, traj, active, traj.batch_size)
        g4 = grads(loop, traj, active, traj.batch_size // 4)
        rel = max(float((g1[n] - g4[n]).norm() / g1[n].norm()) for n in g1 if float(g1[n].norm()) > 0)
        loop.close()
    _common.emit({
        "log_prob_mean_abs_diff": diff,
        "pairs": pairs,
        "grad_split_max_rel_diff": rel,
        "micro_batches": [1, 4],
    })


if __name__ == "__main__":
    main()
