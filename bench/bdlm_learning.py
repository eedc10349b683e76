"""Does GRPO on exact traces teach the tiny block-diffusion LM? (one JSON line on stdout)

Warm start (masked-diffusion SFT) then GRPO with the ``tiny-bdlm`` preset; greedy exact-match
accuracy on the held-out split after each stage:

    {"acc_warm_start": ..., "acc_grpo": ..., "wall_s": ...}

Run alone with ``OMP_NUM_THREADS=1 .venv/bin/python bench/bdlm_learning.py [--set key=value ...]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common
import torch

from diffusionrl.bdlm import evaluate, load_bdlm_config, train_grpo, warm_start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny-bdlm")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="", help="keep the run here (default: a temporary folder)")
    ap.add_argument("--verbose", action="store_true", help="per-step reward and accuracy on stderr")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_bdlm_config(args.preset, args.overrides)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        init_dir = warm_start(cfg, out / "warm", progress=False)
        t_warm = time.perf_counter() - t0
        before = evaluate(cfg, init_dir)
        result = train_grpo(cfg, out / "grpo", init_dir, resume=None, progress=args.verbose)
        after = evaluate(cfg, result.model_dir)
    wall = time.perf_counter() - t0
    if args.verbose:
        import sys

        for m in result.metrics:
            print(f"step {m['step']:.0f} reward {m['rollout/reward/raw_mean']:.3f} "
                  f"exact {m['rollout/reward/exact_mean']:.3f} "
                  f"kl {m.get('train/kl_loss', 0):.4f} zero_std {m['rollout/zero_std/count']:.0f} "
                  f"t {m['perf/step_time']:.2f}s", file=sys.stderr)
    _common.emit({
        "acc_warm_start": round(before["eval/exact_match"], 4),
        "acc_grpo": round(after["eval/exact_match"], 4),
        "reward_warm_start": round(before["eval/reward_mean"], 4),
        "reward_grpo": round(after["eval/reward_mean"], 4),
        "warm_start_s": round(t_warm, 1),
        "wall_s": round(wall, 1),
    })


if __name__ == "__main__":
    main()
