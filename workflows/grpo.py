"""The GRPO pipeline: prompts + base weights -> Ray training -> evaluation -> MLflow registry -> report.

    pyflyte run workflows/grpo.py grpo                                   # embedded default: tiny-cpu-shapes
    pyflyte run workflows/grpo.py grpo --config configs/tiny-cpu.yaml --overrides '["train.steps=5"]'
    pyflyte run --remote workflows/grpo.py grpo --config configs/sd35m-ocr.yaml

``config`` is the whole typed config tree (the Flyte console shows it as a JSON box with the
defaults); ``overrides`` are dotted ``key=value`` strings applied on top and re-validated;
``checkpoint_dir`` (local runs) is a folder that keeps resumable checkpoints across runs: re-run
with the same value to resume an interrupted training. ``sft_steps`` > 0 adds a supervised warm
start before RL (the ``sft`` task: flow matching on ``algorithm.sft_source``'s (prompt, image)
pairs, with the SFT-only dotted ``sft_overrides``, in ``checkpoint_dir/sft``); RL then starts from
its LoRA (``algorithm.init_lora``).

How a config gets in (flytekit's two decoding roads, both through ``Config.from_dict``, so a
partial tree is laid over its preset and an unknown key is an error on every way in):
docs/architecture.md, "How a config gets in".

Prompt data is validated (both splits present, non-empty, disjoint, every row scorable) in
``prepare_prompts``, which ``fetch_base_weights`` waits for: a bad prompt file costs no download.
A config or prompt mistake fails its task with a one-line message; ``pyflyte run`` shows it below a
traceback box of the task's own frame (flytekit prints a box for every non-click exception).

Tracking: every execution is one MLflow run with nested prepare/train/evaluate runs, in
``tracking.uri`` / ``$MLFLOW_TRACKING_URI`` or else the SQLite store ``./runs/mlflow``; an
unreachable store fails the first task. The LoRA is registered as ``tracking.registered_model``
(alias ``candidate``; ``champion`` only when it beats the current champion).
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from flytekit import CronSchedule, LaunchPlan, conditional, workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tasks`, `images` next to `workflows`

from diffusionrl.config import Config, get_preset
from diffusionrl.serving import Registration
from tasks.grpo import (
    evaluate,
    fetch_base_weights,
    fingerprint_prompts,
    nightly_run_dir,
    no_warm_start,
    on_grpo_failure,
    plan_resources,
    prepare_prompts,
    register,
    report,
    resolve_config,
    sft,
    start_run,
    track_inputs,
    train,
)

DEFAULT_CONFIG = get_preset("tiny-cpu-shapes")  # the demo: GenEval in miniature (docs/architecture.md)


class GRPOOutputs(NamedTuple):
    report: FlyteFile
    lora: FlyteDirectory
    trajectories: FlyteDirectory
    metrics: pd.DataFrame
    eval_table: pd.DataFrame
    eval_summary: dict[str, float]
    registered: Registration


@workflow(on_failure=on_grpo_failure)  # marks the execution's open MLflow runs FAILED
def grpo(config: Config = DEFAULT_CONFIG, overrides: list[str] = [], checkpoint_dir: str = "",  # noqa: B006
         on_config_change: str = "fail", sft_steps: int = 0, sft_overrides: list[str] = []) -> GRPOOutputs:  # noqa: B006
    given = resolve_config(config=config, overrides=overrides, sft_steps=sft_steps, sft_overrides=sft_overrides,
                           checkpoint_dir=checkpoint_dir,  # also the run folder's store and owner, sft_source,
                           on_config_change=on_config_change)  # init_lora, on_config_change
    planned = plan_resources(config=given)  # does it fit its GPUs? fails naming the knob, before any pod
    run = start_run(config=given)  # MLflow preflight: fails before any data or weights are fetched
    planned >> run
    prompts = prepare_prompts(data=given.data, reward=given.reward, fingerprint=fingerprint_prompts(data=given.data))
    model = fetch_base_weights(reference=given.model.name, revision=given.model.revision)
    run >> prompts.digest  # (one output stands for its node)
    prompts.digest >> model.digest  # prompts are validated before any weights are fetched
    digests = track_inputs(run=run, config=given, train_prompts=prompts.train, test_prompts=prompts.test,
                           prompts_digest=prompts.digest, model_digest=model.digest)
    # The optional supervised warm start: RL then starts from its LoRA (algorithm.init_lora).
    cfg = (conditional("warm_start").if_(sft_steps > 0)
           .then(sft(config=given, sft_steps=sft_steps, sft_overrides=sft_overrides, model_dir=model.model_dir,
                     checkpoint_dir=checkpoint_dir, run=run, on_config_change=on_config_change))
           .else_().then(no_warm_start(config=given)))
    trained = train(config=cfg, train_prompts=prompts.train, test_prompts=prompts.test, prompts_digest=prompts.digest,
                    model_dir=model.model_dir, checkpoint_dir=checkpoint_dir, run=run,
                    on_config_change=on_config_change)
    digests.test >> trained.run_dir
    ev = evaluate(config=cfg, test_prompts=prompts.test, model_dir=model.model_dir, lora=trained.lora, run=run)
    reg = register(config=cfg, run=run, lora=trained.lora, model_dir=model.model_dir, model_digest=model.digest,
                   test_prompts=prompts.test, test_digest=digests.test, prompts_digest=prompts.digest,
                   eval_summary=ev.summary)
    page = report(config=cfg, metrics=trained.metrics, eval_table=ev.table, eval_summary=ev.summary, grid=ev.grid,
                  lora=trained.lora, trajectories=trained.trajectories, run_dir=trained.run_dir,
                  prompts_digest=prompts.digest, model_digest=model.digest, run=run, registered=reg)
    return GRPOOutputs(page, trained.lora, trained.trajectories, trained.metrics, ev.table, ev.summary, reg)


# The default launch plan, and a nightly re-training (not auto-activated: `pyflyte launchplan
# --activate grpo_nightly` once the cluster is set up) of the GPU recipe `DIFFUSIONRL_NIGHTLY_PRESET`
# (default sd35m-ocr) on the prompt prefix `DIFFUSIONRL_NIGHTLY_PROMPTS`, which an upstream job
# refreshes: the prompt cache keys on that prefix's content (fingerprint_prompts), so each night
# prepares what is there, and register promotes the new LoRA only if it beats the champion.
# `run_date` is the schedule's kickoff time; it names the night's run folder.
grpo_default = LaunchPlan.get_or_create(workflow=grpo, name="grpo_default")

NIGHTLY_CONFIG = get_preset(os.environ.get("DIFFUSIONRL_NIGHTLY_PRESET", "sd35m-ocr"))
NIGHTLY_OVERRIDES = [f"data.source={os.environ.get('DIFFUSIONRL_NIGHTLY_PROMPTS', 's3://diffusionrl-data/prompts/latest/')}"]


@workflow
def grpo_scheduled(run_date: datetime, config: Config = NIGHTLY_CONFIG, overrides: list[str] = [],  # noqa: B006
                   runs_root: str = "") -> GRPOOutputs:
    """``grpo`` for a schedule: the run folder is ``runs_root/<run_date>`` when ``runs_root`` is set
    (each night resumable on its own), else under the execution's raw output prefix."""
    run_dir = nightly_run_dir(runs_root=runs_root, run_date=run_date)
    return grpo(config=config, overrides=overrides, checkpoint_dir=run_dir)


grpo_nightly = LaunchPlan.get_or_create(
    workflow=grpo_scheduled,
    name="grpo_nightly",
    default_inputs={"config": NIGHTLY_CONFIG, "overrides": NIGHTLY_OVERRIDES, "runs_root": ""},
    schedule=CronSchedule(schedule="0 3 * * *", kickoff_time_input_arg="run_date"),
    auto_activate=False,
)
