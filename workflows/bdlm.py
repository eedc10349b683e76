"""The block-diffusion LM pipeline: digit-task data -> masked-diffusion warm start -> GRPO on exact
decoding traces -> evaluation -> MLflow registry -> report (docs/bdlm.md).

    pyflyte run workflows/bdlm.py bdlm                                      # embedded tiny-bdlm defaults
    pyflyte run workflows/bdlm.py bdlm --overrides '["grpo.steps=20", "task.kind=reverse"]'
    pyflyte run workflows/bdlm.py bdlm --checkpoint_dir runs/bdlm          # re-run with it to resume
    pyflyte run workflows/bdlm.py bdlm --config '{"preset": "tiny-diffusiongemma-dapo"}'  # DiffusionGemma

Tracking and registry work as in ``workflows/grpo.py``: one MLflow run per execution (nested
prepare / warm_start / train / evaluate runs); the policy is registered as
``tracking.registered_model`` (default ``tiny-bdlm-sort``) as a pyfunc model that decodes prompts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from flytekit import workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tasks`, `images` next to `workflows`

from diffusionrl.bdlm import BDLMConfig, load_bdlm_config
from diffusionrl.serving import Registration
from tasks.bdlm import (
    evaluate_bdlm,
    on_bdlm_failure,
    prepare_digits,
    register_bdlm,
    report_bdlm,
    resolve_bdlm_config,
    start_bdlm_run,
    track_digits,
    train_bdlm,
    warm_start_stage,
)

DEFAULT_BDLM_CONFIG = load_bdlm_config("tiny-bdlm")


class BDLMOutputs(NamedTuple):
    report: FlyteFile
    warm_start: FlyteDirectory
    model: FlyteDirectory
    traces: FlyteDirectory
    metrics: pd.DataFrame
    eval_table: pd.DataFrame
    eval_summary: dict[str, float]
    registered: Registration


@workflow(on_failure=on_bdlm_failure)  # marks the execution's open MLflow runs FAILED
def bdlm(config: BDLMConfig = DEFAULT_BDLM_CONFIG, overrides: list[str] = [], checkpoint_dir: str = "",  # noqa: B006
         on_config_change: str = "fail") -> BDLMOutputs:
    cfg = resolve_bdlm_config(config=config, overrides=overrides, checkpoint_dir=checkpoint_dir,
                              on_config_change=on_config_change)  # and the run folder's store and owner
    run = start_bdlm_run(config=cfg)  # MLflow preflight first
    data = prepare_digits(task_cfg=cfg.task)
    run >> data.digest
    digests = track_digits(run=run, config=cfg, train=data.train, test=data.test, digest=data.digest)
    warm = warm_start_stage(config=cfg, run=run, checkpoint_dir=checkpoint_dir)
    digests.test >> warm
    trained = train_bdlm(config=cfg, run=run, init_model=warm, checkpoint_dir=checkpoint_dir, data_digest=data.digest,
                         on_config_change=on_config_change)
    ev = evaluate_bdlm(config=cfg, run=run, warm_model=warm, model=trained.model)
    reg = register_bdlm(config=cfg, run=run, model=trained.model, test_digest=digests.test, data_digest=data.digest,
                        eval_summary=ev.summary)
    page = report_bdlm(config=cfg, run=run, metrics=trained.metrics, eval_table=ev.table, eval_summary=ev.summary,
                       model=trained.model, traces=trained.traces, run_dir=trained.run_dir, registered=reg)
    return BDLMOutputs(page, warm, trained.model, trained.traces, trained.metrics, ev.table, ev.summary, reg)
