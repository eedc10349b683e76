"""The tasks of the GRPO workflow (``workflows/grpo.py``; docs/architecture.md, "The DAG").

Each body unpacks typed inputs, calls the ``diffusionrl`` library and packs outputs; no algorithm
code lives here. Locally (``pyflyte run``) images and resources are ignored and the Ray task
starts a local Ray; on a cluster the train task is a KubeRay job.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from flytekit import Cache, Resources, current_context, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile

from diffusionrl.config import Config, ConfigError, DataConfig, RewardConfig, apply_overrides, objective
from diffusionrl.data import PromptSet, load_prompts
from diffusionrl.serving import Registration
from diffusionrl.tracking import TrackingRun
from images import CPU_IMAGE, GPU_IMAGE

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
    retryable_faults,
    run_callbacks,
    stage_dir,
    user_errors,
)
from .resources import (
    ACCELERATOR,
    CPU_TASK,
    ENVIRONMENT,
    GPU_NAME,
    GPU_TASK,
    HF_MLFLOW,
    MLFLOW,
    RAY_CONFIG,
    RAY_ENVIRONMENT,
    REPORT_DECKS,
    TIMEOUTS,
    load_secrets,
    secrets,
)

log = logging.getLogger(__name__)

# Bump when a task's outputs change for the same inputs (the cache key is name + version + inputs).
PREPARE_CACHE = Cache(version="prompts-v2")
FETCH_CACHE = Cache(version="base-weights-v1")
# The train stage's metrics reach MLflow at most this late (and at every checkpoint and the end).
METRICS_FLUSH_S = 10.0


# -- config and tracking --------------------------------------------------------------------------------


@task(container_image=CPU_IMAGE)
@user_errors
def resolve_config(config: Config, overrides: list[str], sft_steps: int, sft_overrides: list[str],
                   checkpoint_dir: str = "", on_config_change: str = "fail") -> Config:
    """Apply dotted ``key=value`` overrides and re-validate the whole tree, and the warm start's config
    when there is one (``sft_steps`` > 0), so a mistake in it fails here, before any data or weights are
    fetched. (A partial tree was laid over its preset and unknown keys rejected before this body runs,
    when flytekit decoded the input: ``ConfigTree.__pre_deserialize__``.) The inputs that need no model
    are checked here too (``training.preflight.check_early``): an object-store ``checkpoint_dir`` this
    task has no credentials for, a missing or malformed ``algorithm.sft_source``, an ``init_lora``
    that is not a LoRA; and the workflow's inputs (``common.check_workflow_inputs``): ``on_config_change``, and
    a ``checkpoint_dir`` whose train (and warm-start) run folder another run owns now."""
    from diffusionrl.training.preflight import check_early

    cfg = Config.from_dict(apply_overrides(config.to_dict(), overrides))
    if sft_steps < 0:
        raise ConfigError(f"sft_steps={sft_steps}: must be >= 0 (0 = no warm start)")
    if sft_steps > 0:
        from diffusionrl.train import sft_config

        check_early(sft_config(cfg, sft_steps, sft_overrides))
    check_early(cfg, checkpoint_dir)
    check_workflow_inputs(on_config_change, checkpoint_dir, ("", "sft") if sft_steps > 0 else ("",))
    return cfg


@task(**CPU_TASK)
@user_errors
def plan_resources(config: Config) -> str:
    """The planner's check before any pod with a GPU starts (``diffusionrl.plan.check``): the
    predicted per-rank peak memory on ``DIFFUSIONRL_GPU``'s GPUs; a config that does not fit fails
    here in one line naming the knobs that fix it. A CPU run (a builtin model on ``auto``/``cpu``)
    passes at once."""
    from diffusionrl.plan.check import check_fits

    line = check_fits(config, GPU_NAME)
    log.info("plan: %s", line)
    return line


@task(**CPU_TASK, secret_requests=MLFLOW)
def start_run(config: Config) -> TrackingRun:
    """Preflight the MLflow store (fails fast, naming the URI) and open this execution's run."""
    load_secrets(MLFLOW)
    from diffusionrl.tracking import resolve_uri, start_workflow_run

    require_shared_store(resolve_uri(config.tracking.uri))
    return start_workflow_run(config, execution_tags())


@task(**CPU_TASK, secret_requests=MLFLOW)
def on_grpo_failure(config: Config, overrides: list[str], checkpoint_dir: str, on_config_change: str,
                    sft_steps: int, sft_overrides: list[str], err: FlyteError | None = None) -> None:
    """Failure handler of ``grpo``: the MLflow runs it left open are marked FAILED."""
    load_secrets(MLFLOW)
    close_failed_runs(resolved_or_given(config, overrides).tracking, err)


@task(**CPU_TASK, secret_requests=MLFLOW)
def track_inputs(run: TrackingRun, config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame,
                 prompts_digest: str, model_digest: str) -> DatasetDigests:
    """The ``prepare`` stage run: prompt splits as MLflow datasets (Parquet + digest) and the data
    and weight digests as lineage tags."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking

    stage = tracking.stage_run(run, "prepare")
    splits = {"train": train_prompts, "test": test_prompts}
    digests = tracking.log_prompt_datasets(run, stage, splits, config.data.source)
    tracking.set_tags(run, {"dataset_digest": prompts_digest, "base_model_digest": model_digest,
                            "dataset_source": config.data.source}, also=[stage])
    client = tracking.client(run.uri)
    for split, df in (("train", train_prompts), ("test", test_prompts)):
        client.log_metric(stage, f"data/{split}_prompts", float(len(df)))
    tracking.finish(run, stage)
    return DatasetDigests(digests["train"], digests["test"])


@task(container_image=CPU_IMAGE)
def nightly_run_dir(runs_root: str, run_date: datetime) -> str:
    """``runs_root/<run_date>`` (e.g. ``s3://bucket/nightly/2026-12-01T03-00``), or '' without a root."""
    return f"{runs_root.rstrip('/')}/{run_date.strftime('%Y-%m-%dT%H-%M')}" if runs_root else ""


# -- prepare_prompts -----------------------------------------------------------------------------------


class Prompts(NamedTuple):
    train: pd.DataFrame
    test: pd.DataFrame
    digest: str
    stats: dict[str, int]


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [r["prompt"] for r in rows],
                         "metadata_json": [json.dumps({k: v for k, v in r.items() if k != "prompt"}, sort_keys=True)
                                           for r in rows]})


def rows_from_frame(df: pd.DataFrame) -> list[dict]:
    return [{"prompt": p, **json.loads(m)} for p, m in zip(df["prompt"], df["metadata_json"])]


@task(container_image=CPU_IMAGE, secret_requests=secrets("hf"))
@user_errors
def fingerprint_prompts(data: DataConfig) -> str:
    """The prompt source's content fingerprint (file bytes, or the store's ETags): the key under which
    ``prepare_prompts`` is cached, so an edited file or a refreshed prefix is prepared again."""
    from diffusionrl.data import source_fingerprint

    return source_fingerprint(data.source)


@task(cache=PREPARE_CACHE, container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"),
      secret_requests=secrets("hf"))
@user_errors
def prepare_prompts(data: DataConfig, reward: RewardConfig, fingerprint: str) -> Prompts:
    """Prompt source -> validated, deterministically split train/test tables + content digest: both
    splits present, non-empty and disjoint, every row scorable by the configured rewards, or a
    ``PromptDataError`` naming the file and line (the workflow fetches no model before this).
    Cached on (``data``, ``reward``, ``fingerprint``): the same content is prepared once."""
    load_secrets(secrets("hf"))
    from diffusionrl.rewards import prompt_validator

    ps = load_prompts(data, validate=prompt_validator(reward))
    log.info("prompts from %s: %s (digest %s)", data.source, ps.stats, ps.digest)
    return Prompts(_frame(ps.train), _frame(ps.test), ps.digest, dict(ps.stats))


# -- fetch_base_weights ----------------------------------------------------------------------------------


class BaseWeights(NamedTuple):
    model_dir: FlyteDirectory
    digest: str


@task(cache=FETCH_CACHE, **CPU_TASK, secret_requests=secrets("hf"), timeout=TIMEOUTS["fetch"], retries=2,
      requests=Resources(cpu="2", mem="8Gi", ephemeral_storage="80Gi"))
@user_errors
def fetch_base_weights(reference: str, revision: str) -> BaseWeights:
    """Model reference -> diffusers folder + digest. ``HF_TOKEN`` comes from the environment (or a
    Flyte secret mounted as that variable) and only ever reaches the hub client."""
    load_secrets(secrets("hf"))
    from diffusionrl.models.fetch import fetch_model, folder_digest

    dest = Path(current_context().working_directory) / "model"
    path = fetch_model(reference, revision, dest)
    digest = folder_digest(path)
    log.info("model %s@%s -> %s (digest %s)", reference, revision or "main", path, digest[:16])
    return BaseWeights(FlyteDirectory(str(path)), digest)


# -- warm start ---------------------------------------------------------------------------------------------


@task(container_image=GPU_IMAGE, environment=ENVIRONMENT, secret_requests=HF_MLFLOW, requests=GPU_TASK,
      accelerator=ACCELERATOR, interruptible=True, retries=3, timeout=TIMEOUTS["train"], enable_deck=False)
@user_errors
def sft(config: Config, sft_steps: int, sft_overrides: list[str], model_dir: FlyteDirectory, checkpoint_dir: str,
        run: TrackingRun, on_config_change: str) -> Config:
    """The optional supervised warm start before RL (``sft_steps`` > 0): ``train.sft_config`` (SFT on
    ``algorithm.sft_source``, then ``sft_overrides``) in the run folder ``checkpoint_dir/sft``, resumed and
    retried like ``train``, metrics in the ``sft`` stage run. Returns the RL config starting from its
    LoRA (``algorithm.init_lora`` = the LoRA's URI in the run folder, also tagged ``warm_start_lora``)."""
    load_secrets(HF_MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.train import sft_config, with_init_lora
    from diffusionrl.train import train as run_training

    allow_change = config_change_allowed(on_config_change)
    sft_cfg = sft_config(config, sft_steps, sft_overrides)
    with open_run_folder(stage_dir(checkpoint_dir, "sft")) as (folder, resume):  # owned until the stage ends
        stage = open_train_stage(run, folder.uri, config.tracking.log_retries, name="sft")
        metrics_cb = tracking.MetricLogger(run.uri, stage, attempts=config.tracking.log_retries)
        with retryable_faults():
            result = run_training(sft_cfg, folder.local, resume=resume, model_path=model_dir.download(),
                                  callbacks=[*run_callbacks(folder, sft_cfg.train.keep_checkpoints), metrics_cb],
                                  allow_config_change=allow_change)
    lora = folder.uri_of(Path(result.model_dir).relative_to(folder.local).as_posix())
    tracking.set_tags(run, {"warm_start_lora": lora}, also=[stage])
    tracking.finish_quietly(run, stage)
    log.info("warm start: %d SFT steps -> %s", result.steps_done, lora)
    return with_init_lora(config, lora)


@task(container_image=CPU_IMAGE)
def no_warm_start(config: Config) -> Config:
    """The RL config as it is (``sft_steps`` = 0)."""
    return config


# -- train --------------------------------------------------------------------------------------------------


class TrainOutputs(NamedTuple):
    lora: FlyteDirectory
    trajectories: FlyteDirectory
    metrics: pd.DataFrame
    run_dir: str


@task(task_config=RAY_CONFIG, container_image=GPU_IMAGE, environment=RAY_ENVIRONMENT, secret_requests=HF_MLFLOW,
      interruptible=True, retries=3, timeout=TIMEOUTS["train"], enable_deck=False)
@user_errors
def train(config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame, prompts_digest: str,
          model_dir: FlyteDirectory, checkpoint_dir: str, run: TrackingRun, on_config_change: str) -> TrainOutputs:
    """The RL loop as a Ray job, in the run folder ``checkpoint_dir`` (a local folder or an object-store
    URI, kept across executions; default: under this attempt's raw output prefix). Resumes, in order,
    from the run folder a previous attempt of this execution recorded in the Flyte checkpoint, from
    the run folder's latest checkpoint, or starts fresh. A resume with changed objective settings
    fails closed unless ``on_config_change="record"`` (the change is then recorded in the run folder)."""
    load_secrets(HF_MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.train import train as run_training
    from diffusionrl.trajectory import TrajectoryWriter

    allow_change = config_change_allowed(on_config_change)  # a bad value fails before anything starts
    with open_run_folder(stage_dir(checkpoint_dir)) as (folder, resume):  # owned until training ends
        # each step's Parquet file, written off the training thread; flushed and verified at checkpoints
        trajectories = TrajectoryWriter(folder.local / "trajectories", run.execution_id, config.train.save_latents)
        prompts = PromptSet(rows_from_frame(train_prompts), rows_from_frame(test_prompts), "flyte")
        stage = open_train_stage(run, folder.uri, config.tracking.log_retries)
        metrics_cb = tracking.MetricLogger(run.uri, stage, images_every=config.train.log_images_every,
                                           attempts=config.tracking.log_retries, flush_every_s=METRICS_FLUSH_S)
        # an objective that trains on a dataset (sft) makes no rollouts: its trajectory folder stays empty
        writers = [trajectories] if objective(config.algorithm.name).rewarded else []
        (folder.local / "trajectories").mkdir(parents=True, exist_ok=True)
        callbacks = [*run_callbacks(folder, config.train.keep_checkpoints, *writers), metrics_cb]
        with retryable_faults():
            result = run_training(config, folder.local, resume=resume, prompts=prompts,
                                  model_path=model_dir.download(), callbacks=callbacks,
                                  allow_config_change=allow_change)
    tracking.finish_quietly(run, stage)
    lora = result.extra_dirs.get("ema", result.model_dir) if config.eval.use_ema else result.model_dir
    return TrainOutputs(FlyteDirectory(str(lora)), FlyteDirectory(folder.uri_of("trajectories")),
                        pd.DataFrame(result.metrics), folder.uri)


# -- evaluate -----------------------------------------------------------------------------------------------


class EvalOutputs(NamedTuple):
    table: pd.DataFrame
    summary: dict[str, float]
    grid: FlyteFile


@task(container_image=GPU_IMAGE, environment=ENVIRONMENT, secret_requests=HF_MLFLOW, requests=GPU_TASK,
      accelerator=ACCELERATOR, timeout=TIMEOUTS["evaluate"], retries=2)
@user_errors
def evaluate(config: Config, test_prompts: pd.DataFrame, model_dir: FlyteDirectory, lora: FlyteDirectory,
             run: TrackingRun) -> EvalOutputs:
    """ODE sampling on held-out prompts with the base model and with the LoRA, same seeds."""
    load_secrets(HF_MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.video import save_picture

    result = evaluate_lora(config, rows_from_frame(test_prompts), lora.download(), model_path=model_dir.download())
    # an image grid as PNG, a video grid (Wan) as an animated GIF
    grid_path = save_picture(result.grid, Path(current_context().working_directory) / "eval_grid.png")
    log.info("evaluation: %s", result.summary)
    tracking.log_evaluation(run, result.summary, result.table, result.grid)
    return EvalOutputs(result.table, result.summary, FlyteFile(str(grid_path)))


# -- register -----------------------------------------------------------------------------------------------


@task(container_image=GPU_IMAGE, environment=ENVIRONMENT, secret_requests=HF_MLFLOW, requests=GPU_TASK,
      accelerator=ACCELERATOR, timeout=TIMEOUTS["register"], retries=2)
def register(config: Config, run: TrackingRun, lora: FlyteDirectory, model_dir: FlyteDirectory, model_digest: str,
             test_prompts: pd.DataFrame, test_digest: str, prompts_digest: str,
             eval_summary: dict[str, float]) -> Registration:
    """Log the LoRA as an ``mlflow.diffusers`` model, register a version (alias ``candidate``) and
    move ``champion`` only if it beats the current one, and the base model, on the same evaluation
    (``eval.champion_metric``, ``eval.champion_over_base``)."""
    load_secrets(HF_MLFLOW)
    from diffusionrl import serving, tracking

    lineage = tracking.lineage(run, dataset_digest=prompts_digest, test_dataset_digest=test_digest,
                               base_model_digest=model_digest, algorithm=config.algorithm.name, preset=config.preset)
    reg = serving.register_lora(run, config, lora.download(), model_dir.download(), model_digest,
                                 rows_from_frame(test_prompts), test_digest, eval_summary, lineage)
    return record_registration(run, reg)


# -- report -------------------------------------------------------------------------------------------------


@task(**CPU_TASK, secret_requests=MLFLOW, enable_deck=True, deck_fields=REPORT_DECKS)
def report(config: Config, metrics: pd.DataFrame, eval_table: pd.DataFrame, eval_summary: dict[str, float],
           grid: FlyteFile, lora: FlyteDirectory, trajectories: FlyteDirectory, run_dir: str,
           prompts_digest: str, model_digest: str, run: TrackingRun, registered: Registration) -> FlyteFile:
    """HTML report (also shown as the task's Flyte Deck and logged to the MLflow run, which it closes)."""
    load_secrets(MLFLOW)
    from diffusionrl import tracking
    from diffusionrl.report import build_report
    from diffusionrl.video import read_frames

    artifacts = report_artifacts(run, registered, run_dir, config.tracking.max_artifact_mb,
                                 lora, "LoRA (peft adapter)" if config.model.finetune == "lora" else
                                 "trained transformer (diffusers model folders)", trajectories, "trajectories",
                                 "trajectories (Parquet, one file per step)")
    artifacts["prompt data digest"] = prompts_digest
    artifacts["base model"] = f"{config.model.name} (digest {model_digest[:16]})"
    page = build_report(config=config.to_dict(), metrics=metrics, eval_table=eval_table, eval_summary=eval_summary,
                        grid=read_frames(grid.download()), artifacts=artifacts)
    tracking.log_final_metrics(run, metrics)
    return publish_report(run, page, run_dir)
