"""Training runs: ``build_loop`` / ``train`` (the library entry) and ``python -m diffusionrl.train``.

    python -m diffusionrl.train --preset tiny-cpu --steps 20 --out runs/tiny \\
        [--config my.yaml] [--set train.learning_rate=1e-3 --set sampling.num_steps=8]

Prints one JSON line of metrics per step, writes ``metrics.jsonl``, checkpoints and the LoRA
(``<out>/lora``). Re-running with the same ``--out`` resumes from the latest checkpoint.

``build_loop`` picks the policy side of the run: ``training.local_worker.LocalPolicyWorker`` in
this process, or ``distributed.ranks.RankGroup`` when ``train.world_size > 1`` (docs/scaling.md);
it sits above both, so neither imports the other.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from diffusionrl.config import Config, ConfigError, describe, load_config
from diffusionrl.runloop import Callback, RunLoop, RunResult, Schedule

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


def build_loop(cfg: Config, out_dir: str | Path, *, prompts=None, callbacks: list[Callback] | None = None,
               progress: bool | None = None, model_path: str | None = None, engine_factory=None,
               scorer=None) -> RunLoop:
    """A ``RunLoop`` over an ``ImageBackend`` for ``cfg``.

    ``prompts`` (a ``data.PromptSet``) defaults to ``cfg.data``'s; ``model_path`` loads the base
    weights from a fetched folder (the identity stays ``cfg.model.name``); ``engine_factory``
    (``(cfg, adapter, policy) -> engine``) and ``scorer`` replace the configured engine and reward.
    """
    import torch

    from diffusionrl.data import load_prompts
    from diffusionrl.rewards import make_scorer, prompt_validator
    from diffusionrl.training.backend import ImageBackend

    torch.manual_seed(cfg.train.seed)
    if cfg.algorithm.name == "sft":  # supervised warm start: (prompt, image) pairs, no rollouts or rewards
        return build_sft_loop(cfg, out_dir, callbacks=callbacks, progress=progress, model_path=model_path)
    if prompts is None:
        prompts = load_prompts(cfg.data, validate=prompt_validator(cfg.reward))
    if cfg.train.world_size > 1:  # the trainer as FSDP2 ranks in Ray actors (docs/scaling.md)
        from diffusionrl.distributed.ranks import RankGroup

        worker = RankGroup(cfg, model_path=model_path, engine_factory=engine_factory)
    else:
        from diffusionrl.training.local_worker import LocalPolicyWorker

        worker = LocalPolicyWorker(cfg, model_path=model_path, engine_factory=engine_factory)
    backend = ImageBackend(cfg, out_dir, prompts, worker, scorer if scorer is not None else make_scorer(cfg.reward))
    tc = cfg.train
    schedule = Schedule(steps=tc.steps, checkpoint_every=tc.checkpoint_every, keep_checkpoints=tc.keep_checkpoints)
    return RunLoop(backend, out_dir, schedule, cfg.to_dict(), callbacks=callbacks, progress=progress)


def build_sft_loop(cfg: Config, out_dir: str | Path, *, callbacks: list[Callback] | None = None,
                   progress: bool | None = None, model_path: str | None = None) -> RunLoop:
    """A ``RunLoop`` over ``training.sft.SFTBackend`` (``algorithm.name=sft``, docs/algorithms.md 14.7)."""
    from diffusionrl.data_sft import load_image_pairs
    from diffusionrl.training.local_worker import LocalPolicyWorker
    from diffusionrl.training.sft import SFTBackend

    rows = load_image_pairs(cfg.algorithm.sft_source, cfg.sampling.resolution, cfg.data.seed)
    worker = LocalPolicyWorker(cfg, model_path=model_path, engine_factory=SFTBackend.no_engine)
    tc = cfg.train
    schedule = Schedule(steps=tc.steps, checkpoint_every=tc.checkpoint_every, keep_checkpoints=tc.keep_checkpoints,
                        postfix_metric="train/loss")
    return RunLoop(SFTBackend(cfg, out_dir, worker, rows), out_dir, schedule, cfg.to_dict(), callbacks=callbacks,
                   progress=progress)


def train_sft(cfg: Config, out_dir: str | Path, source: str | None = None, **kw) -> RunResult:
    """Supervised warm start for ``cfg``'s model and LoRA on ``source`` (default ``algorithm.sft_source``):
    runs ``cfg`` with ``algorithm.name=sft``; the RL run then starts from the result with
    ``algorithm.init_lora=<result.model_dir>``."""
    data = cfg.to_dict()
    data["algorithm"].update(name="sft", sft_source=source or cfg.algorithm.sft_source)
    return train(Config.from_dict(data, where="train_sft"), out_dir, **kw)


def train(cfg: Config, out_dir: str | Path, resume: str | Path | None = "auto", stop_after: int | None = None,
          **kw) -> RunResult:
    """Build a loop for ``cfg`` (``build_loop``'s keywords) and run it to the end."""
    loop = build_loop(cfg, out_dir, **kw)
    try:
        return loop.run(resume=resume, stop_after=stop_after)
    finally:
        loop.close()


class PrintMetrics(Callback):
    def on_step(self, loop, step, batch, metrics) -> None:
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
    result = train(cfg, args.out, resume=None if args.fresh else "auto", callbacks=[PrintMetrics()])
    print(json.dumps({"out": str(result.out_dir), "lora": str(result.model_dir), "steps": result.steps_done}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
