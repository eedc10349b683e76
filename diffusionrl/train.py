"""Training runs: ``build_loop`` / ``train`` (the library entry) and ``python -m diffusionrl.train``.

    python -m diffusionrl.train --preset tiny-cpu --steps 20 --out runs/tiny \\
        [--config my.yaml] [--set train.learning_rate=1e-3 --set sampling.num_steps=8]

Prints one JSON line of metrics per step, writes ``metrics.jsonl``, checkpoints and the LoRA
(``<out>/lora``). Re-running with the same ``--out`` resumes from the latest intact checkpoint (a
damaged one is skipped with a warning) with the same settings: raising ``--steps`` continues the
run, changing what is optimised (learning rate, data, seed, ...) needs ``--allow-config-change``
(each change is recorded in ``<out>/config_changes.jsonl``), and so does a prompt file, SFT pair
set or initial LoRA rewritten at the same path (their digests are in the checkpoint,
``input_digests``). Two runs cannot share ``--out``: the second refuses in one line naming the
first (``diffusionrl.run.lock``). ``--fresh`` starts over in ``--out``: the previous run's
checkpoints, metrics.jsonl and config.json are moved to ``<out>/previous-run-<time>/``, never
deleted (its lora/ is replaced when the new run ends; its final LoRA stays in its last checkpoint).
A mistake in the config, the prompts or the run folder (a ``diffusionrl.errors.UserError``) is one
line on stderr and exit status 2; the prompts are loaded and checked before the model.

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

from diffusionrl.config import Config, apply_overrides, describe, load_config
from diffusionrl.errors import run_cli
from diffusionrl.heldout import HackingAlarm
from diffusionrl.run import RUN_CONTROL_KEYS, Callback, RunLoop, RunResult, Schedule

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
    "heldout/reward_mean",
    "heldout/diversity",
    "alarm/hacking",
)

# Config keys a resumed image run (RL or SFT) may change (``run.loop.RUN_CONTROL_KEYS`` and these): how long to
# run, checkpoint cadence, what is logged, and the layout (ranks, engines, actors, threads, device),
# which does not change the objective (2 ranks give one process's gradient, docs/scaling.md).
FREE_KEYS = RUN_CONTROL_KEYS + (
    "train.steps", "train.checkpoint_every", "train.keep_checkpoints", "train.log_images_every",
    "train.save_latents", "train.world_size", "train.placement", "train.rollout_engines", "train.cpus_per_bundle",
    "train.engine_gpu_fraction", "train.memory_handoff", "train.offload_optimizer", "train.deterministic",
    "train.max_idle_steps", "train.max_skipped_fraction", "train.checkpoint_format",
    "sampling.sglang_*", "reward.num_actors", "reward.ocr_threads", "model.device", "model.gradient_checkpointing",
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
    from diffusionrl.run import check_local_out
    from diffusionrl.training.backend import ImageBackend
    from diffusionrl.training.guard import UpdateGuard

    check_local_out(out_dir)  # before any data or weights are loaded
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
        # Once, now: which prompts the text encoders cut short (else diffusers says it on every encoding).
        all_prompts = [r["prompt"] for r in prompts.train + prompts.test]
        worker.adapter.warn_truncated(all_prompts, cfg.model.max_sequence_length)
    backend = ImageBackend(cfg, out_dir, prompts, worker, scorer if scorer is not None else make_scorer(cfg.reward))
    train_cfg = cfg.train
    schedule = Schedule(steps=train_cfg.steps, checkpoint_every=train_cfg.checkpoint_every,
                        keep_checkpoints=train_cfg.keep_checkpoints)
    # every image run watches its held-out probes for reward hacking (diffusionrl.heldout), and stops
    # when it stops updating (training.guard: last, so the tripping step's metrics are written and synced)
    return RunLoop(backend, out_dir, schedule, cfg.to_dict(),
                   callbacks=[HackingAlarm(), *(callbacks or []), UpdateGuard(cfg.train)],
                   progress=progress, free_keys=FREE_KEYS, inputs=input_digests(cfg, prompts=prompts))


def build_sft_loop(cfg: Config, out_dir: str | Path, *, callbacks: list[Callback] | None = None,
                   progress: bool | None = None, model_path: str | None = None) -> RunLoop:
    """A ``RunLoop`` over ``training.sft.SFTBackend`` (``algorithm.name=sft``, docs/algorithms.md 14.7)."""
    from diffusionrl.data import load_image_pairs
    from diffusionrl.run import check_local_out
    from diffusionrl.training.guard import UpdateGuard
    from diffusionrl.training.local_worker import LocalPolicyWorker
    from diffusionrl.training.sft import SFTBackend

    check_local_out(out_dir)
    rows = load_image_pairs(cfg.algorithm.sft_source, cfg.sampling.resolution, cfg.data.seed)
    worker = LocalPolicyWorker(cfg, model_path=model_path, engine_factory=SFTBackend.no_engine)
    train_cfg = cfg.train
    schedule = Schedule(steps=train_cfg.steps, checkpoint_every=train_cfg.checkpoint_every,
                        keep_checkpoints=train_cfg.keep_checkpoints, postfix_metric="train/loss", postfix_label="loss")
    return RunLoop(SFTBackend(cfg, out_dir, worker, rows), out_dir, schedule, cfg.to_dict(),
                   callbacks=[*(callbacks or []), UpdateGuard(cfg.train)], progress=progress,
                   free_keys=FREE_KEYS, inputs=input_digests(cfg, sft_rows=rows))


def input_digests(cfg: Config, prompts=None, sft_rows: list[dict] | None = None) -> dict[str, str]:
    """Digests of the data behind the config's paths, which ``RunLoop`` records in every checkpoint
    and compares on resume like the config (``--allow-config-change`` lets them differ, recorded):
    the prompts as loaded (``PromptSet.digest``, the digest of the MLflow datasets and the
    ``dataset_digest`` tag), the SFT pairs (each row's prompt, fields and pixels) and the
    ``algorithm.init_lora`` weights (``adapter_model.safetensors``, the file the policy loads).

    The base weights' digest is not here: it is in the checkpoint's ``metadata`` (``model_digest``),
    which a resume must match whatever it allows. Kept beside ``build_loop`` rather than in the
    backends' ``metadata`` because this is data the caller chose, not the policy's identity."""
    out: dict[str, str] = {}
    if prompts is not None:
        out["prompts"] = prompts.digest
    if sft_rows is not None:
        from diffusionrl.data import rows_digest

        out["sft_pairs"] = rows_digest(sft_rows)
    if cfg.algorithm.init_lora:
        out["init_lora"] = file_digest(f"{str(cfg.algorithm.init_lora).rstrip('/')}/adapter_model.safetensors")
    return out


def file_digest(uri: str) -> str:
    """sha256 (16 hex) of the file at a local path or an object-store URI."""
    from diffusionrl.digest import file_sha256

    return file_sha256(uri).hexdigest()[:16]


def sft_config(cfg: Config, steps: int | None = None, overrides: list[str] = (), source: str | None = None) -> Config:
    """The supervised warm start before the RL run ``cfg``: the same model, LoRA and data seed with
    ``algorithm.name=sft`` on ``source`` (default ``algorithm.sft_source``), ``steps`` steps (default
    ``train.steps``), in one process (``train.world_size=1``), from ``algorithm.init_lora`` if set,
    then the SFT-only dotted ``overrides`` (e.g. ``train.learning_rate=1e-4``), validated like any config."""
    data = cfg.to_dict()
    data["algorithm"].update(name="sft", sft_source=source or cfg.algorithm.sft_source)
    data["train"]["world_size"] = 1
    if steps is not None:
        data["train"]["steps"] = steps
    return Config.from_dict(apply_overrides(data, list(overrides)), where="the SFT stage")


def with_init_lora(cfg: Config, lora: str) -> Config:
    """``cfg`` starting from the LoRA folder or URI ``lora`` (``algorithm.init_lora``)."""
    data = cfg.to_dict()
    data["algorithm"]["init_lora"] = str(lora)
    return Config.from_dict(data, where="the RL stage after a warm start")


def train_sft(cfg: Config, out_dir: str | Path, source: str | None = None, **kw) -> RunResult:
    """Supervised warm start for ``cfg``'s model and LoRA on ``source`` (``sft_config``); the RL run
    then starts from the result with ``with_init_lora(cfg, result.model_dir)``."""
    return train(sft_config(cfg, source=source), out_dir, **kw)


def train(cfg: Config, out_dir: str | Path, resume: str | Path | None = "auto", stop_after: int | None = None,
          allow_config_change: bool = False, **kw) -> RunResult:
    """Build a loop for ``cfg`` (``build_loop``'s keywords) and run it to the end (``RunLoop.run``).
    ``out_dir`` is owned from before the model loads (``run.lock``): a folder another run holds
    fails at once, naming it, not after minutes of loading.

    Args:
        cfg (`Config`): the run's config (``load_config``).
        out_dir (`str` or `Path`): a local folder: checkpoints, ``metrics.jsonl``, ``lora/``.
        resume (`str`, `Path` or `None`, *optional*, defaults to ``"auto"``): ``"auto"`` resumes from
            ``out_dir``'s latest intact checkpoint if there is one; a checkpoint folder resumes from it;
            `None` starts fresh (earlier run files are moved aside).
        stop_after (`int`, *optional*, defaults to `None`): stop after this many steps of this call.
        allow_config_change (`bool`, *optional*, defaults to `False`): resume although objective settings
            or input digests differ from the checkpoint's (each change recorded).
        **kw: ``build_loop``'s keywords (``prompts``, ``callbacks``, ``progress``, ``model_path``,
            ``engine_factory``, ``scorer``).

    Returns:
        `RunResult`: the output folder, the LoRA folder (``model_dir``), the metric rows, the steps done and
        the last checkpoint.
    """
    from diffusionrl.run import check_local_out, hold_run_folder

    check_local_out(out_dir)  # a URI here would be a local folder named like it (memory:/x): refused first
    with hold_run_folder(out_dir):
        loop = build_loop(cfg, out_dir, **kw)
        try:
            return loop.run(resume=resume, stop_after=stop_after, allow_config_change=allow_config_change)
        finally:
            loop.close()


class PrintMetrics(Callback):
    def on_step(self, loop, step, batch, metrics) -> None:
        row = {"step": step, **{k: round(metrics[k], 6) for k in KEYS if k in metrics}}
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m diffusionrl.train`` (and the ``diffusionrl-train`` script); see the module docstring.

    Args:
        argv (`list[str]`, *optional*, defaults to `None`): the arguments (`None`: ``sys.argv[1:]``):
            ``--preset NAME``, ``--config FILE``, ``--set KEY=VALUE`` (repeatable), ``--steps N``,
            ``--out DIR`` (default ``runs/train``), ``--fresh``, ``--allow-config-change``, ``--help-config``.

    Returns:
        `int`: the exit status: 0, or 2 for a mistake in the config, the prompts or the run folder (one line
        on stderr).
    """
    ap = argparse.ArgumentParser(prog="python -m diffusionrl.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="named preset (default: tiny-cpu, or the file's 'preset')")
    ap.add_argument("--config", default=None, help="YAML/JSON config file applied over the preset")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted override, e.g. train.learning_rate=1e-3 (repeatable)")
    ap.add_argument("--steps", type=int, default=None, help="shorthand for --set train.steps=N")
    ap.add_argument("--out", required=False, default="runs/train",
                    help="local output folder (resumes if it has checkpoints; not a URI)")
    ap.add_argument("--fresh", action="store_true",
                    help="start a new run in --out even if it holds one: that run's checkpoints/, metrics.jsonl and "
                         "config.json are moved to <out>/previous-run-<time>/ (never deleted)")
    ap.add_argument("--allow-config-change", action="store_true",
                    help="resume although objective-relevant settings (learning rate, data, seed, ...) differ from "
                         "the checkpoint's; each change is recorded in <out>/config_changes.jsonl")
    ap.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    args = ap.parse_args(argv)
    if args.help_config:
        print(describe())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])

    def run() -> None:  # a mistake in the config or the prompts: one line, exit status 2 (run_cli)
        cfg = load_config(args.preset, args.config, overrides)
        result = train(cfg, args.out, resume=None if args.fresh else "auto", callbacks=[PrintMetrics()],
                       allow_config_change=args.allow_config_change)
        print(json.dumps({"out": str(result.out_dir), "lora": str(result.model_dir), "steps": result.steps_done}))

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
