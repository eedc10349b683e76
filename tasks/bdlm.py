"""The tasks of the block-diffusion LM workflow (``workflows/bdlm.py``).

data -> warm start -> GRPO on exact traces -> evaluation -> MLflow registration -> report. Like
``tasks/grpo.py`` each body unpacks inputs, calls ``diffusionrl.bdlm`` and packs outputs; the
MLflow run tree, lineage tags, retries and the registry decision are shared with the image workflow
(``tasks/common.py``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from flytekit import Cache, Resources, current_context, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile

from diffusionrl.bdlm.config import BDLMConfig, TaskConfig
from diffusionrl.config import apply_overrides
from diffusionrl.serving import Registration
from diffusionrl.tracking import TrackingRun
from images import CPU_IMAGE

from .common import (
    DatasetDigests,
    check_workflow_inputs,
    close_failed_runs,
    config_change_allowed,
    execution_tags,
    open_run_folder,
    open_train_stage,
    publish_report,
    record_registration,
    report_artifacts,
    require_shared_store,
    resolved_or_given,
    run_callbacks,
    stage_dir,
    user_errors,
)
from .resources import CPU_TASK, MLFLOW, REPORT_DECKS, load_secrets

log = logging.getLogger(__name__)

DIGITS_CACHE = Cache(version="digits-v1")


@task(container_image=CPU_IMAGE)
@user_errors
def resolve_bdlm_config(config: BDLMConfig, overrides: list[str], checkpoint_dir: str = "",
                        on_config_change: str = "fail") -> BDLMConfig:
    """The validated config; an object-store ``checkpoint_dir`` this task has no credentials for fails
    here, in one line naming it (``run.folder.check_store_access``), not inside training, and so do a bad
    ``on_config_change`` and a ``checkpoint_dir`` whose GRPO run folder another run owns now
    (``common.check_workflow_inputs``)."""
    from diffusionrl.run import check_run_folder, check_store_access

    cfg = BDLMConfig.from_dict(apply_overrides(config.to_dict(), overrides))
    if checkpoint_dir:
        check_run_folder(checkpoint_dir)
        check_store_access(checkpoint_dir, "checkpoint_dir")
    check_workflow_inputs(on_config_change, checkpoint_dir, ("grpo",))
    return cfg


@task(**CPU_TASK, secret_requests=MLFLOW)
def on_bdlm_failure(config: BDLMConfig, overrides: list[str], checkpoint_dir: str, on_config_change: str,
                    err: FlyteError | None = None) -> None:
    """Failure handler of ``bdlm``: the MLflow runs it left open are marked FAILED."""
    load_secrets(MLFLOW)
    close_failed_runs(resolved_or_given(config, overrides).tracking, err)


@task(**CPU_TASK, secret_requests=MLFLOW)
def start_bdlm_run(config: BDLMConfig) -> TrackingRun:
    """Preflight the MLflow store (fails fast, naming the URI) and open this execution's run."""
    load_secrets(MLFLOW)
    from diffusionrl.bdlm.objectives import OBJECTIVES
    from diffusionrl.tracking import resolve_uri, start_workflow_run

    require_shared_store(resolve_uri(config.tracking.uri))
    return start_workflow_run(config, execution_tags(),
                              {"algorithm": OBJECTIVES[config.grpo.objective], "task": config.task.kind})


class DigitSplits(NamedTuple):
    train: pd.DataFrame
    test: pd.DataFrame
    digest: str


@task(cache=DIGITS_CACHE, container_image=CPU_IMAGE)
def prepare_digits(task_cfg: TaskConfig) -> DigitSplits:
    """The generated train/test splits of the digit task, as tables with their digest."""
    from diffusionrl.bdlm.task import split_frames

    return DigitSplits(*split_frames(task_cfg))


@task(**CPU_TASK, secret_requests=MLFLOW)
def track_digits(run: TrackingRun, config: BDLMConfig, train: pd.DataFrame, test: pd.DataFrame,
                 digest: str) -> DatasetDigests:
    """The ``prepare`` stage run: splits as MLflow datasets; data and initial-weight digests as tags."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.bdlm import load_bdlm, weights_digest

    stage = tracking.stage_run(run, "prepare")
    digests = tracking.log_prompt_datasets(run, stage, {"train": train, "test": test}, f"task:{config.task.kind}")
    base = weights_digest(load_bdlm(config.model.name, config.model))
    tracking.set_tags(run, {"dataset_digest": digest, "base_model_digest": base,
                            "dataset_source": f"task:{config.task.kind}"}, also=[stage])
    tracking.finish(run, stage)
    return DatasetDigests(digests["train"], digests["test"])


@task(**CPU_TASK, secret_requests=MLFLOW, requests=Resources(cpu="2", mem="4Gi"))
def warm_start_stage(config: BDLMConfig, run: TrackingRun, checkpoint_dir: str) -> FlyteDirectory:
    """Masked-diffusion supervised warm start (``warm_start`` stage run: its loss per step)."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.bdlm import warm_start
    from diffusionrl.run import RunFolder

    staging = Path(current_context().working_directory) / "warm"
    folder = RunFolder(stage_dir(checkpoint_dir, "warm_start"), staging=staging)
    stage = tracking.stage_run(run, "warm_start")
    model_dir = warm_start(config, folder.local)
    folder.push_changed()
    tracking.log_metrics_file(run, stage, folder.local / "metrics.jsonl", config.tracking.log_retries)
    tracking.finish_quietly(run, stage)
    return FlyteDirectory(str(model_dir))


class BDLMTrainOutputs(NamedTuple):
    model: FlyteDirectory
    traces: FlyteDirectory
    metrics: pd.DataFrame
    run_dir: str


@task(**CPU_TASK, secret_requests=MLFLOW, requests=Resources(cpu="2", mem="4Gi"), interruptible=True, retries=3,
      timeout=timedelta(hours=24))
def train_bdlm(config: BDLMConfig, run: TrackingRun, init_model: FlyteDirectory, checkpoint_dir: str,
               data_digest: str, on_config_change: str) -> BDLMTrainOutputs:
    """GRPO on exact traces. Resumes from this execution's Flyte checkpoint (a retried attempt),
    else from ``checkpoint_dir/grpo/checkpoints``, else starts from the warm start."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.bdlm import train_grpo
    from diffusionrl.bdlm.task import split_frames

    if split_frames(config.task)[2] != data_digest:
        raise RuntimeError(f"the digit task generator no longer reproduces the prepared data (digest {data_digest}); "
                           "bump prepare_digits' cache version")
    allow_change = config_change_allowed(on_config_change)  # a bad value fails before anything starts
    with open_run_folder(stage_dir(checkpoint_dir, "grpo")) as (folder, resume):  # owned until training ends
        stage = open_train_stage(run, folder.uri, config.tracking.log_retries)
        logger = tracking.MetricLogger(run.uri, stage, attempts=config.tracking.log_retries)
        callbacks = [*run_callbacks(folder, config.grpo.keep_checkpoints), logger]
        result = train_grpo(config, folder.local, init_model.download(), resume=resume, callbacks=callbacks,
                            allow_config_change=allow_change)
    tracking.finish_quietly(run, stage)
    return BDLMTrainOutputs(FlyteDirectory(str(result.model_dir)), FlyteDirectory(folder.uri_of("traces")),
                            pd.DataFrame(result.metrics), folder.uri)


class BDLMEvalOutputs(NamedTuple):
    table: pd.DataFrame
    summary: dict[str, float]


@task(**CPU_TASK, secret_requests=MLFLOW, requests=Resources(cpu="2", mem="4Gi"))
def evaluate_bdlm(config: BDLMConfig, run: TrackingRun, warm_model: FlyteDirectory,
                  model: FlyteDirectory) -> BDLMEvalOutputs:
    """Greedy decoding of the held-out split by the warm start ("base") and the GRPO policy."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.bdlm import compare

    table, summary = compare(config, warm_model.download(), model.download())
    tracking.log_evaluation(run, summary, table)
    return BDLMEvalOutputs(table, summary)


@task(**CPU_TASK, secret_requests=MLFLOW, requests=Resources(cpu="2", mem="4Gi"))
def register_bdlm(config: BDLMConfig, run: TrackingRun, model: FlyteDirectory, test_digest: str,
                  data_digest: str, eval_summary: dict[str, float]) -> Registration:
    """Log the policy as a pyfunc model that decodes prompts, register a version (``candidate``)
    and move ``champion`` only if it beats the current one, and the warm-start model, on the same
    evaluation (``eval.champion_metric``, ``eval.champion_over_base``)."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.bdlm.serving import register_bdlm_model

    parent = tracking.client(run.uri).get_run(run.run_id).data.tags
    lineage = tracking.lineage(run, dataset_digest=data_digest, test_dataset_digest=test_digest,
                               task=config.task.kind, algorithm=parent.get("algorithm", ""), preset=config.preset)
    reg = register_bdlm_model(run, config, model.download(), test_digest, eval_summary, lineage)
    return record_registration(run, reg)


@task(**CPU_TASK, secret_requests=MLFLOW, enable_deck=True, deck_fields=REPORT_DECKS)
def report_bdlm(config: BDLMConfig, run: TrackingRun, metrics: pd.DataFrame, eval_table: pd.DataFrame,
                eval_summary: dict[str, float], model: FlyteDirectory, traces: FlyteDirectory, run_dir: str,
                registered: Registration) -> FlyteFile:
    """HTML report (Deck, a copy in the run folder, an artifact of the MLflow run, which it closes)."""
    load_secrets(MLFLOW)
    from diffusionrl.report import build_report

    artifacts = report_artifacts(run, registered, run_dir, config.tracking.max_artifact_mb,
                                 model, "policy (bdlm_model.json + weights)", traces, "traces",
                                 "traces (Parquet, one file per step)")
    page = build_report(config=config.to_dict(), metrics=metrics, eval_table=eval_table, eval_summary=eval_summary,
                        grid=None, artifacts=artifacts, title="diffusionrl block-diffusion LM report")
    return publish_report(run, page, run_dir)
