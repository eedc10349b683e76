"""The tasks of the GRPO workflow (``workflows/grpo.py``; docs/architecture.md, "The DAG").

Each body unpacks typed inputs, calls the ``diffusionrl`` library and packs outputs; no algorithm
code lives here. Locally (``pyflyte run``) images and resources are ignored and the Ray task
starts a local Ray; on a cluster the train task is a KubeRay job.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd
from flytekit import Cache, Resources, current_context, task
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from diffusionrl.callbacks import Callback
from diffusionrl.config import Config, DataConfig, RewardConfig, apply_overrides
from diffusionrl.data import PromptSet, load_prompts
from diffusionrl.tracking import TrackingRun
from images import CPU_IMAGE, GPU_IMAGE

from .common import (
    DatasetDigests,
    RegisteredVersion,
    close_failed_runs,
    execution_tags,
    open_run_folder,
    open_train_stage,
    publish_report,
    resolved_or_given,
    run_callbacks,
    stage_dir,
)

log = logging.getLogger(__name__)

# Bump when a task's outputs change for the same inputs (the cache key is name + version + inputs).
PREPARE_CACHE = Cache(version="prompts-v1")
FETCH_CACHE = Cache(version="checkpoint-v1")


# -- config and tracking --------------------------------------------------------------------------------


@task(container_image=CPU_IMAGE)
def resolve_config(config: Config, overrides: list[str]) -> Config:
    """Apply dotted ``key=value`` overrides and re-validate the whole tree."""
    return Config.from_dict(apply_overrides(config.to_dict(), overrides))


@task(container_image=CPU_IMAGE)
def start_run(config: Config) -> TrackingRun:
    """Preflight the MLflow store (fails fast, naming the URI) and open this execution's run."""
    from diffusionrl.tracking import start_workflow_run

    return start_workflow_run(config, execution_tags())


@task(container_image=CPU_IMAGE)
def on_grpo_failure(config: Config, overrides: list[str], checkpoint_dir: str, err: Optional[FlyteError] = None) -> None:
    """Failure handler of ``grpo``: the MLflow runs it left open are marked FAILED."""
    close_failed_runs(resolved_or_given(config, overrides).tracking, err)


@task(container_image=CPU_IMAGE)
def track_inputs(run: TrackingRun, config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame,
                 prompts_digest: str, model_digest: str) -> DatasetDigests:
    """The ``prepare`` stage run: prompt splits as MLflow datasets (Parquet + digest) and the data
    and weight digests as lineage tags."""
    from diffusionrl import tracking

    stage = tracking.stage_run(run, "prepare")
    digests = tracking.log_prompt_datasets(run, stage, {"train": train_prompts, "test": test_prompts}, config.data.source)
    tracking.set_tags(run, {"dataset_digest": prompts_digest, "base_model_digest": model_digest,
                            "dataset_source": config.data.source}, also=[stage])
    client = tracking.client(run.uri)
    for split, df in (("train", train_prompts), ("test", test_prompts)):
        client.log_metric(stage, f"data/{split}_prompts", float(len(df)))
    tracking.finish(run, stage)
    return DatasetDigests(digests["train"], digests["test"])


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


@task(cache=PREPARE_CACHE, container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
def prepare_prompts(data: DataConfig, reward: RewardConfig) -> Prompts:
    """Prompt source -> validated, deterministically split train/test tables + content digest."""
    from diffusionrl.rewards import prompt_validator

    ps = load_prompts(data, validate=prompt_validator(reward))
    log.info("prompts from %s: %s (digest %s)", data.source, ps.stats, ps.digest)
    return Prompts(_frame(ps.train), _frame(ps.test), ps.digest, dict(ps.stats))


# -- fetch_checkpoint ------------------------------------------------------------------------------------


class Checkpoint(NamedTuple):
    model_dir: FlyteDirectory
    digest: str


@task(cache=FETCH_CACHE, container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="8Gi", ephemeral_storage="60Gi"))
def fetch_checkpoint(reference: str, revision: str) -> Checkpoint:
    """Model reference -> diffusers folder + digest. ``HF_TOKEN`` comes from the environment (or a
    Flyte secret mounted as that variable) and only ever reaches the hub client."""
    from diffusionrl.models.fetch import fetch_model, folder_digest

    dest = Path(current_context().working_directory) / "model"
    path = fetch_model(reference, revision, dest)
    digest = folder_digest(path)
    log.info("model %s@%s -> %s (digest %s)", reference, revision or "main", path, digest[:16])
    return Checkpoint(FlyteDirectory(str(path)), digest)


# -- train --------------------------------------------------------------------------------------------------


class TrainOutputs(NamedTuple):
    lora: FlyteDirectory
    trajectories: FlyteDirectory
    metrics: pd.DataFrame
    run_dir: str


class ParquetTrajectories(Callback):
    """Each step's trajectory as one Parquet file (``docs/trajectories.md``)."""

    def __init__(self, traj_dir: Path, run_id: str, latents: bool):
        self.traj_dir, self.run_id, self.latents = traj_dir, run_id, latents

    def on_step(self, loop, step, batch, metrics) -> None:
        from diffusionrl.trajectory_store import write_step

        write_step(self.traj_dir, batch, run_id=self.run_id, step=step, images=True, latents=self.latents)


# The reference layout (sd35m-ocr: train.world_size=2, colocated): the head holds 2 GPU bundles of
# 4 CPUs (a trainer rank + an SGLang engine each) plus the driver; `train-gpu` workers (2 GPUs
# each) join when train.world_size grows past the head's GPUs; reward actors run on `reward-cpu`.
# Several nodes need checkpoint_dir and the model folder on shared storage (docs/scaling.md).
_GPU_NODE = Resources(cpu="10", mem="96Gi", gpu="2")
RAY_CONFIG = RayJobConfig(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-cpus": "10", "num-gpus": "2", "log-color": "False"},
        requests=_GPU_NODE,
        limits=_GPU_NODE,
    ),
    worker_node_config=[
        WorkerNodeConfig(group_name="train-gpu", replicas=0, min_replicas=0, max_replicas=4,
                         requests=_GPU_NODE, limits=_GPU_NODE),
        WorkerNodeConfig(group_name="reward-cpu", replicas=1, min_replicas=0, max_replicas=4,
                         requests=Resources(cpu="8", mem="16Gi")),
    ],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)


@task(task_config=RAY_CONFIG, container_image=GPU_IMAGE, interruptible=True, retries=3, enable_deck=False)
def train(config: Config, train_prompts: pd.DataFrame, test_prompts: pd.DataFrame, prompts_digest: str,
          model_dir: FlyteDirectory, checkpoint_dir: str, run: TrackingRun) -> TrainOutputs:
    """The RL loop as a Ray job, in the run folder ``checkpoint_dir`` (a local folder or an object-store
    URI, kept across executions; default: under this attempt's raw output prefix). Resumes, in order,
    from the run folder a previous attempt of this execution recorded in the Flyte checkpoint, from
    the run folder's latest checkpoint, or starts fresh."""
    from diffusionrl import tracking
    from diffusionrl.train import train as run_training

    folder, resume = open_run_folder(stage_dir(checkpoint_dir))
    trajectories = ParquetTrajectories(folder.local / "trajectories", run.execution_id, config.train.save_latents)
    prompts = PromptSet(rows_from_frame(train_prompts), rows_from_frame(test_prompts), "flyte")
    stage = open_train_stage(run, folder.uri, config.tracking.log_retries)
    metrics_cb = tracking.MetricLogger(run.uri, stage, images_every=config.train.log_images_every,
                                       attempts=config.tracking.log_retries)
    callbacks = [*run_callbacks(folder, config.train.keep_checkpoints, trajectories), metrics_cb]
    try:
        result = run_training(config, folder.local, resume=resume, prompts=prompts, model_path=model_dir.download(),
                              callbacks=callbacks)
    except (ConnectionError, TimeoutError) as exc:  # engine/server faults: worth a retry
        raise FlyteRecoverableException(f"transient failure in training: {exc}") from exc
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            raise FlyteRecoverableException(f"out of memory: {exc}") from exc
        raise
    tracking.finish_quietly(run, stage)
    lora = result.extra_dirs.get("ema", result.model_dir) if config.eval.use_ema else result.model_dir
    return TrainOutputs(FlyteDirectory(str(lora)), FlyteDirectory(folder.uri_of("trajectories")),
                        pd.DataFrame(result.metrics), folder.uri)


# -- evaluate -----------------------------------------------------------------------------------------------


class EvalOutputs(NamedTuple):
    table: pd.DataFrame
    summary: dict[str, float]
    grid: FlyteFile


@task(container_image=GPU_IMAGE, requests=Resources(cpu="4", mem="32Gi", gpu="1"))
def evaluate(config: Config, test_prompts: pd.DataFrame, model_dir: FlyteDirectory, lora: FlyteDirectory,
             run: TrackingRun) -> EvalOutputs:
    """ODE sampling on held-out prompts with the base model and with the LoRA, same seeds."""
    from PIL import Image

    from diffusionrl import tracking
    from diffusionrl.evaluation import evaluate_lora

    result = evaluate_lora(config, rows_from_frame(test_prompts), lora.download(), model_path=model_dir.download())
    grid_path = Path(current_context().working_directory) / "eval_grid.png"
    Image.fromarray(result.grid).save(grid_path)
    log.info("evaluation: %s", result.summary)
    tracking.log_evaluation(run, result.summary, result.table, result.grid)
    return EvalOutputs(result.table, result.summary, FlyteFile(str(grid_path)))


# -- register -----------------------------------------------------------------------------------------------


@task(container_image=GPU_IMAGE, requests=Resources(cpu="4", mem="32Gi", gpu="1"))
def register(config: Config, run: TrackingRun, lora: FlyteDirectory, model_dir: FlyteDirectory, model_digest: str,
             test_prompts: pd.DataFrame, test_digest: str, prompts_digest: str,
             eval_summary: dict[str, float]) -> RegisteredVersion:
    """Log the LoRA as an ``mlflow.diffusers`` model, register a version (alias ``candidate``) and
    move ``champion`` only if it beats the current one on the same evaluation."""
    from diffusionrl import registry, tracking

    lineage = tracking.lineage(run, dataset_digest=prompts_digest, test_dataset_digest=test_digest,
                               base_model_digest=model_digest, algorithm=config.algorithm.name, preset=config.preset)
    reg = registry.register_lora(run, config, lora.download(), model_dir.download(), model_digest,
                                 rows_from_frame(test_prompts), test_digest, eval_summary["eval/reward_mean"], lineage)
    return RegisteredVersion.record(run, reg)


# -- report -------------------------------------------------------------------------------------------------


@task(container_image=CPU_IMAGE, enable_deck=True)
def report(config: Config, metrics: pd.DataFrame, eval_table: pd.DataFrame, eval_summary: dict[str, float],
           grid: FlyteFile, lora: FlyteDirectory, trajectories: FlyteDirectory, run_dir: str,
           prompts_digest: str, model_digest: str, run: TrackingRun, registered: RegisteredVersion) -> FlyteFile:
    """HTML report (also shown as the task's Flyte Deck and logged to the MLflow run, which it closes)."""
    import numpy as np
    from PIL import Image

    from diffusionrl import tracking
    from diffusionrl.report import build_report

    traj_path = trajectories.remote_source or trajectories.path
    traj_where = tracking.log_folder_or_link(run, run.run_id, traj_path, trajectories.download, "trajectories",
                                             config.tracking.max_artifact_mb)
    artifacts = {
        **registered.links(),
        "LoRA (peft adapter)": lora.remote_source or lora.path,
        "trajectories (Parquet, one file per step)": traj_path,
        "trajectories in MLflow": traj_where,
        "run folder (checkpoints, metrics.jsonl)": run_dir,
        "prompt data digest": prompts_digest,
        "base model": f"{config.model.name} (digest {model_digest[:16]})",
    }
    page = build_report(config=config.to_dict(), metrics=metrics, eval_table=eval_table, eval_summary=eval_summary,
                        grid=np.asarray(Image.open(grid.download()).convert("RGB")), artifacts=artifacts)
    tracking.log_final_metrics(run, metrics)
    return publish_report(run, page, run_dir)
