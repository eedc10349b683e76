"""``python -m diffusionrl.train``: the RL loop without Flyte.

    python -m diffusionrl.train --preset tiny-cpu --steps 20 --out runs/tiny \\
        [--config my.yaml] [--set train.learning_rate=1e-3 --set sampling.num_steps=8]

Prints one JSON line of metrics per step, writes ``metrics.jsonl``, checkpoints and the LoRA
(``<out>/lora``). Re-running with the same ``--out`` resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from diffusionrl.config import ConfigError, describe, load_config

KEYS = (
    "rollout/reward/raw_mean",
    "rollout/reward/raw_std",
    "rollout/zero_std/count",
    "train/loss",
    "train/kl_loss",
    "train/approx_kl",
    "train/clipfrac",
    "train/log_prob_mean_abs_diff",
    "train/grad_norm",
    "perf/step_time",
)


class PrintMetrics:
    def on_step(self, loop, step, traj, metrics) -> None:
        row = {"step": step, **{k: round(metrics[k], 6) for k in KEYS if k in metrics}}
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffusionrl.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="named preset (default: tiny-cpu, or the file's 'preset')")
    ap.add_argument("--config", default=None, help="YAML/JSON config file applied over the preset")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted override, e.g. train.learning_rate=1e-3 (repeatable)")
    ap.add_argument("--steps", type=int, default=None, help="shorthand for --set train.steps=N")
    ap.add_argument("--out", required=False, default="runs/train", help="output folder (resumes if it has checkpoints)")
    ap.add_argument("--fresh", action="store_true", help="ignore existing checkpoints in --out")
    ap.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    args = ap.parse_args(argv)
    if args.help_config:
        print(describe())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    try:
        cfg = load_config(args.preset, args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from diffusionrl.training.loop import train

    result = train(cfg, args.out, resume=None if args.fresh else "auto", callbacks=[PrintMetrics()])
    print(json.dumps({"out": str(result.out_dir), "lora": str(result.lora_dir), "steps": result.steps_done}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
